"""Everything the scheduler needs next to it, built once from the runtime options.

The in-process Engine and the server's scheduler process both start here, so they load the same way and
report the same model info. With ``tp_size > 1`` this process becomes rank 0: ``load`` checks that the
model splits, spawns the follower ranks and joins them (``radixrt.distributed.world``); ``check_ranks`` and
``close`` are for the loop that runs the scheduler.
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
    world: Any = None  # radixrt.distributed.world.TPWorld under tensor parallelism

    @classmethod
    def load(cls, args: ServerArgs) -> "LoadedModel":
        from radixrt.model.runner import ModelRunner
        from radixrt.model.weights import resolve_model_path
        from radixrt.distributed.options import check_dist_args
        from radixrt.tokenizer import chat_template_info, eos_token_ids, load_tokenizer

        check_dist_args(args)
        model_path = resolve_model_path(args.model)
        world = _start_world(args, model_path) if args.tp_size != 1 or args.nnodes != 1 else None
        try:
            tokenizer = load_tokenizer(args.tokenizer_path or model_path, args.chat_template)
            runner = ModelRunner.from_args(model_path, args, world)
        except BaseException as exc:
            if world is not None:
                world.abort(f"rank 0 failed to load: {exc!r}")
                world.close()
            raise
        eos_ids = eos_token_ids(model_path, tokenizer)
        try:
            from radixrt.constrained import GrammarBackend

            grammars = GrammarBackend(tokenizer, eos_ids, runner.config.vocab_size,
                                      jump_forward=not args.disable_jump_forward)
        except ImportError:
            grammars = None
        return cls(args, model_path, tokenizer, runner, eos_ids, grammars, chat_template_info(tokenizer), world)

    def check_ranks(self) -> None:
        """RankFailure once a tensor-parallel follower has died (nothing to check on one rank)."""
        if self.world is not None:
            self.world.check()

    def close(self) -> None:
        """Stop the follower ranks; call from the thread that ran the scheduler's steps (or after it ended)."""
        if self.world is not None:
            self.world.close()

    def model_info(self) -> dict[str, Any]:
        """What `Engine.get_model_info()` and the server's `/get_model_info` return."""
        return {
            "model_path": str(self.model_path),
            "served_model_name": self.args.served_model_name or self.args.model,
            "weight_version": self.args.weight_version,  # an update of weights may change it and model_path
            "context_length": self.runner.context_length,
            "vocab_size": self.runner.config.vocab_size,
            "dtype": str(self.runner.dtype).replace("torch.", ""),
            "page_size": self.runner.page_size,
            "chat_template": self.chat_template,
            "eos_token_ids": sorted(self.eos_ids),
            "is_generation": not self.runner.embedding_only,  # SGLang's key: False for an embedding model
            # a classifier's labels, by index (its config's id2label): /v1/classify names the likeliest
            "classifier_labels": _labels(self.runner.config) if self.runner.classifier else None,
        }


def _labels(config) -> list[str]:
    names = getattr(config, "id2label", None) or {}
    return [str(names.get(i, names.get(str(i), f"LABEL_{i}"))) for i in range(config.num_labels)]


def _start_world(args: ServerArgs, model_path: Path):
    """Rank 0 of a tensor-parallel runtime, after the checks that need no other rank."""
    from radixrt.distributed.world import TPWorld
    from radixrt.model.llama import check_tensor_parallel
    from radixrt.model.runner import load_config

    if args.node_rank != 0:
        raise ValueError("this process runs rank 0 (node 0); other nodes run `radixrt serve --node-rank N`")
    check_tensor_parallel(load_config(model_path, args.model_overrides()), args.tp_size)
    return TPWorld.start_driver(args.replace(model=str(model_path)))
