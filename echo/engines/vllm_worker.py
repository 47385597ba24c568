"""Methods vLLM mixes into its worker processes (`LLM(worker_extension_cls=...)`), called with
`llm.collective_rpc(name, args)`: full-weight updates in place, without a restart."""

from __future__ import annotations


class WeightsReloader:
    def echo_reload_weights(self, paths: list[str]) -> None:
        """Load every tensor of these safetensors files (Hugging Face names) into the running
        model. `model.load_weights` works only once on some platforms (the CPU backend repacks
        linear weights after loading and drops their loaders); `reload_weights` re-arms them."""
        from safetensors import safe_open

        def tensors():
            for path in paths:
                with safe_open(path, "pt") as f:
                    for name in f.keys():
                        yield name, f.get_tensor(name)

        self.reload_weights(weights_iterator=tensors(), is_checkpoint_format=True)
        # With tied embeddings the lm_head shares the embedding's weight, but a backend that
        # packed its own copy of it at load time (the CPU one) keeps the old one: pack it again.
        model = self.model_runner.model
        if getattr(self.model_runner.model_config.hf_config, "tie_word_embeddings", False):
            model.lm_head.quant_method.process_weights_after_loading(model.lm_head)
