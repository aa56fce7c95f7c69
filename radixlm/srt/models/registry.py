"""Architecture name (config.json `architectures[0]`) -> model class; model construction."""
from __future__ import annotations

import torch
from torch import nn

from radixlm.config import ModelConfig
from radixlm.registry import Registry
from radixlm.srt.distributed.context import TPContext
from radixlm.srt.models.gemma3 import Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3ForConditionalGeneration
from radixlm.srt.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
from radixlm.srt.models.phi3 import Phi3ForCausalLM
from radixlm.srt.models.mixtral import MixtralForCausalLM
from radixlm.srt.models.qwen3 import Qwen3ForCausalLM
from radixlm.srt.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_ARCHS: Registry[type[nn.Module]] = Registry("model architecture")
MODEL_ARCHS.register("LlamaForCausalLM")(LlamaForCausalLM)
MODEL_ARCHS.register("Qwen2ForCausalLM")(Qwen2ForCausalLM)
MODEL_ARCHS.register("MistralForCausalLM")(MistralForCausalLM)
MODEL_ARCHS.register("Gemma3ForCausalLM")(Gemma3ForCausalLM)
MODEL_ARCHS.register("Gemma3ForConditionalGeneration")(Gemma3ForConditionalGeneration)
MODEL_ARCHS.register("Gemma2ForCausalLM")(Gemma2ForCausalLM)
MODEL_ARCHS.register("Phi3ForCausalLM")(Phi3ForCausalLM)
MODEL_ARCHS.register("Qwen3ForCausalLM")(Qwen3ForCausalLM)
MODEL_ARCHS.register("Qwen3MoeForCausalLM")(Qwen3MoeForCausalLM)
MODEL_ARCHS.register("MixtralForCausalLM")(MixtralForCausalLM)


def build_model(model_config: ModelConfig, dtype: torch.dtype, device: str | torch.device,
                tp: TPContext | None = None) -> nn.Module:
    """An unloaded model (parameters allocated with torch.empty, no init) on `device`; with
    `tp`, the shard of one tensor-parallel rank."""
    cls = MODEL_ARCHS.get(model_config.architecture)
    with torch.device(device):
        model = cls(model_config, dtype, tp)
    return model.eval()


def load_model(path: str, model_config: ModelConfig, dtype: torch.dtype,
               device: str | torch.device) -> nn.Module:
    """build_model + load_weights from a GGUF file or Hugging Face directory."""
    from radixlm.srt.weights.loader import iter_weights

    model = build_model(model_config, dtype, device)
    with torch.no_grad():
        model.load_weights(iter_weights(path, model_config))
    return model
