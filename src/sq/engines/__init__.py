"""Serving engines as checkers: score an output the way it will be served (docs/serving.md).

``vllm_client`` runs in sq's venv and drives ``vllm_worker`` in vLLM's own venv; ``compare`` puts
vLLM's perplexity and greedy tokens beside transformers' for one checkpoint.
"""
