"""The Engine's calls for reinforcement-learning loops, as SGLang's Engine names them: updates of weights (from a
checkpoint on disk or from tensors), pauses, weight versions, memory released between rollouts (and vLLM's
``sleep`` / ``wake_up`` / ``is_sleeping``). A base of ``radixrt.engine.Engine``; each is a control
call (``Engine._call``) the scheduler serves between steps (radixrt.scheduler.weights)."""

from __future__ import annotations

from typing import Any

from radixrt.protocol.errors import RequestError
from radixrt.protocol.messages import (
    Broadcast,
    ContinueReq,
    Control,
    DestroyWeightGroupReq,
    InitWeightGroupReq,
    PauseReq,
    ReleaseMemoryReq,
    ResumeMemoryReq,
    UpdateWeightsReq,
    sleep_release,
    WeightsByNameReq,
    WeightVersionReq,
)


class WeightCalls:
    client: Any  # the Engine's SchedulerClient

    def _call(self, body: Control) -> Any:  # the Engine's
        raise NotImplementedError

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None,
                                 abort_all_requests: bool = False, weight_version: str | None = None,
                                 flush_cache: bool = True) -> tuple[bool, str, int]:
        """SGLang's: serve the weights of the checkpoint at ``model_path`` (a folder, a GGUF file or a hub id: the
        served model with other weights) once the requests in flight have finished (``abort_all_requests``: abort
        them); requests made meanwhile wait. ``flush_cache`` drops the prefix cache (computed with the old
        weights); ``weight_version`` names the new weights. Returns ``(success, message, 0)``: on failure the
        served weights stay."""
        from radixrt.model.weights import ModelNotFoundError, resolve_update_path

        try:
            if load_format not in (None, "auto", "safetensors"):
                raise RequestError(f"load_format {load_format!r}: radixrt reads safetensors (auto)")
            folder = resolve_update_path(model_path)
            out = self._call(UpdateWeightsReq(str(folder), abort_all_requests, weight_version, flush_cache))
        except (RequestError, ModelNotFoundError) as exc:
            return False, f"weights not updated: {exc}", 0
        return True, out.message, 0

    def update_weights_from_tensor(self, named_tensors: list[tuple[str, Any]], load_format: str | None = None,
                                   flush_cache: bool = True, abort_all_requests: bool = False,
                                   weight_version: str | None = None) -> tuple[bool, str]:
        """SGLang's: serve these ``(name, tensor)`` pairs (names as in the checkpoint's safetensors files, any subset:
        a trainer's bucket) in place of the served tensors, the rest kept, with ``update_weights_from_disk``'s
        order (it waits for the requests in flight). The runtime keeps every tensor sent since the checkpoint was
        read (host memory up to the model's size; an update from disk clears them). Returns ``(success, message)``."""
        from radixrt.model.reload import tensor_record

        try:
            if load_format not in (None, "auto"):
                raise RequestError(f"load_format {load_format!r}: radixrt takes the tensors as they are (auto)")
            records = [tensor_record(name, tensor) for name, tensor in named_tensors]
            out = self._call(UpdateWeightsReq(None, abort_all_requests, weight_version, flush_cache, records))
        except RequestError as exc:
            return False, f"weights not updated: {exc}"
        return True, out.message

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str = "nccl") -> tuple[bool, str]:
        """SGLang's: join a trainer's process group (the trainer is rank 0 and hosts the rendezvous at
        ``master_address:master_port``) as rank ``rank_offset`` of ``world_size``, for
        ``update_weights_from_distributed``. Returns once every rank has joined. ``backend``: ``gloo`` (a runtime on
        a CPU) or ``nccl`` (on CUDA). Trainers create their side with
        ``radixrt.model.weight_group.init_custom_process_group`` (or SGLang's)."""
        try:
            out = self._call(InitWeightGroupReq(master_address, int(master_port), int(rank_offset), int(world_size),
                                                group_name, backend))
        except RequestError as exc:
            return False, str(exc)
        return True, out.message

    def update_weights_from_distributed(self, names: list[str], dtypes: list[Any], shapes: list[list[int]],
                                        group_name: str = "weight_update_group", flush_cache: bool = True,
                                        abort_all_requests: bool = False, weight_version: str | None = None,
                                        load_format: str | None = None) -> tuple[bool, str]:
        """SGLang's: serve the tensors the trainer broadcasts from rank 0 of ``group_name``, in this order (names as
        in the checkpoint's safetensors files, dtypes as torch names them or ``torch.dtype``), with
        ``update_weights_from_tensor``'s rules: it waits for the requests in flight, the tensors not sent stay.
        Returns ``(success, message)``."""
        try:
            if load_format not in (None, "auto"):
                raise RequestError(f"load_format {load_format!r}: radixrt takes the tensors as they are (auto)")
            broadcast = Broadcast(list(names), [str(dtype).removeprefix("torch.") for dtype in dtypes],
                                  [[int(size) for size in shape] for shape in shapes], group_name)
            out = self._call(UpdateWeightsReq(None, abort_all_requests, weight_version, flush_cache,
                                              broadcast=broadcast))
        except RequestError as exc:
            return False, f"weights not updated: {exc}"
        return True, out.message

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> tuple[bool, str]:
        try:
            return True, self._call(DestroyWeightGroupReq(group_name)).message
        except RequestError as exc:
            return False, str(exc)

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """SGLang's: the served values of checkpoint tensor ``name`` (its first ``truncate_size`` rows, float32, as
        ``model.get_parameter(name)[:truncate_size].tolist()`` gives them in transformers), for checking that an
        update landed. A ``NotFound`` (a ``ValueError``) for a name the checkpoint lacks."""
        return self._call(WeightsByNameReq(name, int(truncate_size))).values

    def pause_generation(self, mode: str = "abort", clear_cache: bool = False) -> None:
        """SGLang's: no step runs until ``continue_generation``; requests made meanwhile wait. ``abort`` ends the
        requests in flight, ``retract`` frees their pages (computed again later), ``in_place`` keeps them, ``wait``
        (vLLM's) returns once they have finished. ``clear_cache``: then drop the prefix cache (not ``in_place``)."""
        self._call(PauseReq(mode, clear_cache))

    def continue_generation(self) -> None:
        self._call(ContinueReq())

    def is_paused(self) -> bool:
        """vLLM's: whether generation is paused (by the last pause or continue answered)."""
        return bool(self.client.paused)

    def get_weight_version(self) -> str:
        return self._call(WeightVersionReq()).weight_version

    def update_weight_version(self, new_version: str, abort_all_requests: bool = False) -> str:
        """Name the served weights ``new_version`` (each response's ``meta_info["weight_version"]``)."""
        return self._call(WeightVersionReq(new_version, abort_all_requests)).weight_version

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """SGLang's: give back the memory of ``tags`` (``weights``, ``kv_cache``, ``cuda_graph``; None: all) until
        ``resume_memory_occupation``; requests made meanwhile wait. The KV cache's prefixes are dropped; resumed
        weights are their checkpoint's (send updated tensors again). A ``RequestError`` (a ``ValueError``) while
        requests hold KV pages: wait for them or ``pause_generation`` first (radixrt.scheduler.occupation)."""
        self._call(ReleaseMemoryReq(list(tags) if tags else None))

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        """SGLang's: take the memory of ``tags`` (None: all released) again; once nothing is released, waiting
        requests run."""
        self._call(ResumeMemoryReq(list(tags) if tags else None))

    def sleep(self, level: int = 1) -> None:
        """vLLM's: level 1 discards the KV cache and moves the weights to host memory, to come back as they were (on a
        CPU they are in host memory already and stay); level 2 discards both (resumed weights are their
        checkpoint's)."""
        self._call(sleep_release(level))

    def wake_up(self, tags: list[str] | None = None) -> None:
        """vLLM's: take back what ``sleep`` gave (``tags``: ``weights``, ``kv_cache``; None: all)."""
        self.resume_memory_occupation(tags)

    def is_sleeping(self) -> bool:
        """vLLM's: whether any memory is given back (by the last release or resume answered)."""
        return bool(self.client.released)

