"""The model: loaded by name or hub id, placed on a device, wrapped with its adapter.

loading.py      models and tokenizers by name, a local folder or a hub id; a model's digest
hf_hub.py       Hugging Face Hub ids (owner/name@revision) and the commit a run pins them to
devices.py      which device and dtype a process computes on
policy.py       the policy: base model with a LoRA adapter (or full weights), and its log-probs
"""
