"""radixlm: an LLM serving engine with a radix-tree prefix cache at its centre."""
from radixlm.config import ServerArgs
from radixlm.sampling_params import SamplingParams
from radixlm.version import __version__
__all__ = ["Engine", "SamplingParams", "ServerArgs", "__version__"]


def __getattr__(name: str):
    # Engine pulls in torch and the model code; keep `import radixlm` light.
    if name == "Engine":
        from radixlm.srt.engine import Engine
        return Engine
    raise AttributeError(name)
