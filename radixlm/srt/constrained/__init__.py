"""Structured output: xgrammar compilation and matchers, the token bitmask, response_format.

The scheduler sees only `GrammarBackend` (radixlm/scheduler/grammar_queue.py); everything
that touches xgrammar lives here and is imported lazily, so `import radixlm` stays light.
"""
