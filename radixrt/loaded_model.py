"""Everything the scheduler needs next to it, built once from the runtime options.

The in-process Engine and the server's scheduler process both start here, so they load the same way and
report the same model info.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from radixrt.server_args import ServerArgs


@dataclass
class LoadedModel:
    args: ServerArgs
    model_path: Path
    tokenizer: Any
    runner: Any  # radixrt.model.runner.ModelRunner
    eos_ids: set[int]
    grammars: Any  # radixrt.constrained.GrammarBackend, or None where constrained decoding is unavailable
    chat_template: dict[str, Any] | None

    @classmethod
    def load(cls, args: ServerArgs) -> "LoadedModel":
        from radixrt.model.runner import ModelRunner
        from radixrt.model.weights import resolve_model_path
        from radixrt.tokenizer import chat_template_info, eos_token_ids, load_tokenizer

        model_path = resolve_model_path(args.model)
        tokenizer = load_tokenizer(model_path)
        runner = ModelRunner(
            model_path,
            dtype=args.dtype,
            page_size=args.page_size,
            num_pages=args.max_total_pages,
            kv_memory_gb=args.kv_memory_gb,
            attention_backend=args.attention_backend,
            context_length=args.context_length,
            device=args.device,
        )
        eos_ids = eos_token_ids(model_path, tokenizer)
        try:
            from radixrt.constrained import GrammarBackend

            grammars = GrammarBackend(tokenizer, eos_ids, runner.config.vocab_size,
                                      jump_forward=not args.disable_jump_forward)
        except ImportError:
            grammars = None
        return cls(args, model_path, tokenizer, runner, eos_ids, grammars, chat_template_info(tokenizer))

    def model_info(self) -> dict[str, Any]:
        """What `Engine.get_model_info()` and the server's `/get_model_info` return."""
        return {
            "model_path": str(self.model_path),
            "served_model_name": self.args.served_model_name or self.args.model,
            "context_length": self.runner.context_length,
            "vocab_size": self.runner.config.vocab_size,
            "dtype": str(self.runner.dtype).replace("torch.", ""),
            "page_size": self.runner.page_size,
            "chat_template": self.chat_template,
            "eos_token_ids": sorted(self.eos_ids),
        }
