"""TRL integration: make a TRL ``GRPOTrainer`` (``use_vllm=True``, peft LoRA) sync vLLM with ``merged_lora_params``.

One line, after the trainer is built and before ``trainer.train()``::

    from merge.trl import use_merged_lora_sync
    use_merged_lora_sync(trainer)

What it replaces. In TRL 1.16 every weight sync goes through one method, ``VLLMGeneration.sync_weights`` of the
trainer's ``trainer.vllm_generation`` object: ``GRPOTrainer._generate_single_turn`` and ``GRPOTrainer._generate``
(custom ``rollout_func``) call it when ``state.global_step != _last_loaded_step``, and
``VLLMGeneration.generate`` calls it to re-push weights discarded by sleep mode. ``use_merged_lora_sync`` sets an
instance attribute ``sync_weights`` on that one object (the class, and any other trainer, keep TRL's method), so
all three call sites reach ours while their own bookkeeping (``_last_loaded_step``, profiling) stays TRL's.

Stock 1.16 (``_iter_named_params``): ``merge_adapter()`` on the whole model, stream every parameter (under FSDP2
``full_tensor()`` per parameter; its ``# TODO: does this work with FSDP?``), ``unmerge_adapter()``; in colocate mode
each pair goes to ``model.load_weights``. That writes the trainer's weights twice per sync (in bf16 the round trip does
not give back the same bits: https://github.com/huggingface/trl/issues/6688), and ``load_weights`` fails on vLLM-CPU,
which repacks linears for oneDNN and empties the originals. Ours, :class:`MergedLoraSync`:

- the same preamble: sleep mode wakes the engine's weights up (``empty_cache()``, ``wake_up(tags=["weights"])``)
  and clears ``_llm_weights_sleeping``;
- streams ``merged_lora_params(model)``: one decoder layer unsharded at a time (FSDP2) or none (unsharded),
  ``W + scaling * (B @ A)`` computed out of place, base-model names cleaned as TRL cleans them; the trainer's
  parameters are never written;
- colocate: pushes with vLLM's layer-wise in-place reload (``merge.vllm_compat.reload_vllm_weights``:
  ``collective_rpc("reload_weights", ...)``, plus the CPU MoE repacking vLLM 0.32 skips): it works where
  ``load_weights`` cannot, and everywhere else too, cast to the engine's dtype; server: the main process streams
  through TRL's own client, ``vllm_client.update_named_params(metadata, pairs)``, every other process iterates
  alongside (the unsharding is a collective); the ``(name, dtype, shape)`` metadata is collected on the first sync,
  as TRL does;
- the same epilogue: ``reset_prefix_cache()`` on the engine, or on the server from the main process.

Server mode against a ``lora_merge`` server (``--weight-transfer-config '{"backend": "lora_merge"}'``): only the
LoRA factors travel. TRL opens its NCCL communicator while the trainer is built (``VLLMGeneration._init_vllm`` calls
``vllm_client.init_communicator``), which conflicts with that backend (and fails on CPU), so build the trainer inside
:func:`lora_merge_server_client`: TRL's ``VLLMClient`` is built as is, and its ``init_communicator`` (on that
instance) asks the server for its weight-transfer backend first, opening TRL's communicator only for vLLM's stock
``nccl``. The sync then follows the backend: ``lora_merge``, every process gathers the factors
(``merge.lora_merge.LoraMergeTrainer.send_weights``, a collective under FSDP2) and the main process sends them, the
server merging them into its pristine base; ``nccl``, the merged stream above. Generation stays TRL's own
(``/v1/completions`` on the same server); its failures, and the sync's, become one :class:`TRLServerError` line.

Why that is safe: ``sync_weights`` takes no arguments and returns nothing, and the callers only rely on the
engine holding the trainer's current weights afterwards, which is what it does. It is pinned to the TRL versions
it was checked against (:data:`SUPPORTED_TRL`); any other version is refused with a message, not patched.

TRL 1.16 cannot pass engine arguments to its colocate ``LLM(...)``; where its defaults do not fit (vLLM's "auto"
dtype serves an fp32 checkpoint in bf16; on CPU the KV cache is sized from ``VLLM_CPU_KVCACHE_SPACE``, whole GiB,
and ``enforce_eager`` avoids a long compile), build the trainer inside :func:`vllm_engine_kwargs`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from merge.layers import check_supported, decoder_layers
from merge.merged_params import merged_lora_params
from merge.server_health import results_watching_health, start_in_daemon_threads
from merge.server_settings import server_setting_problems
from merge.vllm_compat import reload_vllm_weights

__all__ = [
    "SUPPORTED_TRL",
    "UnsupportedTRLVersionError",
    "TRLServerError",
    "lora_merge_server_client",
    "check_trl_version",
    "use_merged_lora_sync",
    "install_merged_lora_sync",
    "MergedLoraSync",
    "push_merged_lora_to_llm",
    "merged_lora_weights",
    "vllm_engine_kwargs",
    "check_fsdp2_layout",
]

SUPPORTED_TRL = SpecifierSet(">=1.16.0,<1.17.0")
"""TRL versions whose ``VLLMGeneration.sync_weights`` seam (callers, preamble, epilogue, client API) was read."""


LORA_MERGE_FLAG = """--weight-transfer-config '{"backend": "lora_merge"}'"""
RESUME_HINT = "restart the server, then resume the run from its last checkpoint (resume_from_checkpoint)"


class UnsupportedTRLVersionError(RuntimeError):
    """The installed TRL is not one this integration was checked against."""


class TRLServerError(RuntimeError):
    """TRL's vLLM server cannot take this sync, or stopped answering mid-run (one line: the URL, what, what to do)."""


def check_trl_version(version: str | None = None) -> None:
    """Raise :class:`UnsupportedTRLVersionError` unless ``version`` (default: the installed TRL's) is supported."""
    if version is None:
        import trl

        version = trl.__version__
    if not SUPPORTED_TRL.contains(Version(version), prereleases=True):
        raise UnsupportedTRLVersionError(
            f"merge.trl supports trl{SUPPORTED_TRL} (1.16.x), but trl {version} is installed. It replaces "
            "VLLMGeneration.sync_weights, which it was checked against only in those versions; install "
            "`trl>=1.16,<1.17`, or read the new version's sync (trl/generation/vllm_generation.py) and widen "
            "merge.trl.SUPPORTED_TRL."
        )


def _vllm_name(name: str) -> str:
    """TRL's own name cleanup (``VLLMGeneration._fix_param_name_to_vllm``): drop activation-checkpoint wrappers."""
    return name.replace("_checkpoint_wrapped_module.", "")


def check_fsdp2_layout(model: torch.nn.Module) -> None:
    """Under FSDP2, ``merged_lora_params`` needs each decoder layer to be its own ``fully_shard`` group.

    A layer left to the root's group would be merged from its local shards, and a group nested inside a layer
    (a size-based wrap policy) would stay sharded while its layer is unsharded; both are refused here.
    """
    if not any(isinstance(p, DTensor) for p in model.parameters()):
        return
    for i, layer in enumerate(decoder_layers(model)):
        if not isinstance(layer, FSDPModule):
            raise ValueError(
                f"FSDP2: decoder layer {i} is not a fully_shard group of its own; shard each decoder "
                "layer, then the root (accelerate: fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP)"
            )
        nested = [name for name, m in layer.named_modules() if name and isinstance(m, FSDPModule)]
        if nested:
            raise ValueError(
                f"FSDP2: decoder layer {i} contains its own fully_shard groups {nested[:3]}; only "
                "whole decoder layers (and the root) can be groups (TRANSFORMER_BASED_WRAP)"
            )


def merged_lora_weights(model: torch.nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``merged_lora_params(model, dtype)`` under the names vLLM loads (TRL's cleanup applied)."""
    return ((_vllm_name(name), tensor) for name, tensor in merged_lora_params(model, dtype=dtype))


def push_merged_lora_to_llm(model: torch.nn.Module, llm, dtype: torch.dtype | None = None) -> None:
    """The colocate sync: stream the merged weights into an in-process ``vllm.LLM``, then reset its prefix cache.

    Exactly what :class:`MergedLoraSync` does in colocate mode (without sleep mode), so it can be timed alone.
    ``dtype``: the tensors' dtype on the way in; default the engine's own. Under FSDP2 this is a collective:
    every rank calls it, in step (each rank pushes into its own engine).
    """
    dtype = dtype or llm.llm_engine.model_config.dtype
    reload_vllm_weights(llm, merged_lora_weights(model, dtype))


def _gone(url: str, what_happened: str) -> TRLServerError:
    """The one line a run stops with when the server goes away mid-run: the URL, what happened, how to resume."""
    return TRLServerError(f"the vLLM server at {url} {what_happened}; {RESUME_HINT}")


def _on_server(url: str, what: str, call: Callable, *args, **kwargs):
    """``call`` (an HTTP call of TRL's client or of the lora_merge trainer), its failures as one `TRLServerError`
    line: TRL's client raises a bare ``Exception("Request failed: <status>, <text>")`` for an error answer."""
    import requests

    try:
        return call(*args, **kwargs)
    except TRLServerError:
        raise
    except requests.RequestException as error:  # TRL's own retries are spent by now
        raise _gone(url, f"stopped answering while {what} ({type(error).__name__})") from None
    except Exception as error:
        if not str(error).startswith("Request failed"):
            raise
        raise _gone(url, f"failed while {what} ({' '.join(str(error)[:300].split())})") from None


def _watching_health(url: str, what: str, call: Callable, server_timeout: float):
    """``call()`` on a daemon thread, its result once done, the server's /health probed meanwhile
    (`merge.server_health`): failing for ``server_timeout`` seconds ends the wait with one line (a front end
    shutting down keeps open requests waiting, and TRL's client sets no timeout)."""

    def gone(problem: str, seconds: float) -> TRLServerError:
        return _gone(url, f"stopped answering while {what} ({problem} for {seconds:.0f} s)")

    [future] = start_in_daemon_threads([lambda: _on_server(url, what, call)], max_workers=1)
    return results_watching_health([future], url, server_timeout, gone)[0]


def server_backend(client) -> str | None:
    """The weight-transfer backend of the server behind TRL's ``client`` ("lora_merge", "nccl"; None: none), from
    its ``/server_info`` (TRL's ``get_server_info``, which names ``VLLM_SERVER_DEV_MODE=1`` where it is missing).
    Its settings are checked on the way as the recipe checks them (`merge.server_settings`): a server that cannot
    serve the run is refused in one line naming each flag. Its dtype and prefix cache are TRL's business (TRL
    resets the prefix cache after every sync)."""
    try:
        config = client.get_server_info()
    except RuntimeError as error:  # TRL's message: the dev routes are missing
        raise TRLServerError(" ".join(str(error).split())) from None
    problems = server_setting_problems(config)
    if problems:
        raise TRLServerError(f"the vLLM server at {client.base_url} cannot serve this run: {'; '.join(problems)}")
    return (config.get("weight_transfer_config") or {}).get("backend")


def _refuse_no_backend(url: str) -> TRLServerError:
    return TRLServerError(
        f"the vLLM server at {url} has no weight-transfer backend, so no sync can reach it: start it with "
        f"{LORA_MERGE_FLAG} (this package installed where it runs: the factors travel) or vLLM's "
        """'{"backend": "nccl"}' (CUDA; the merged weights travel), see docs/trl.md"""
    )


@contextlib.contextmanager
def lora_merge_server_client():
    """Build TRL's server-mode trainer inside this block so that, against a ``lora_merge`` server, TRL opens no NCCL
    communicator (the factor-only sync connects at its first sync); against vLLM's ``nccl`` backend TRL opens its
    own, as without the block. The name ``VLLMClient`` in ``trl.generation.vllm_generation`` is swapped for the
    block only; each client is TRL's own class, with ``init_communicator`` replaced on that instance.

        with lora_merge_server_client():
            trainer = GRPOTrainer(..., args=GRPOConfig(use_vllm=True, vllm_mode="server", ...))
        use_merged_lora_sync(trainer)
    """
    import trl.generation.vllm_generation as vllm_generation

    from merge.lora_merge import BACKEND

    check_trl_version()
    trl_client = vllm_generation.VLLMClient

    def build_client(*args, **kwargs):
        try:
            client = trl_client(*args, **kwargs)
        except ConnectionError as error:  # TRL's own, after its connection timeout
            hint = f" (start it with {LORA_MERGE_FLAG}: docs/trl.md)"
            raise TRLServerError(" ".join(str(error).split()) + hint) from None
        open_trl_communicator = client.init_communicator

        def init_communicator(device=0):
            client.weight_transfer_backend = server_backend(client)
            if client.weight_transfer_backend is None:
                raise _refuse_no_backend(client.base_url)
            if client.weight_transfer_backend != BACKEND:
                open_trl_communicator(device)

        client.init_communicator = init_communicator
        return client

    vllm_generation.VLLMClient = build_client
    try:
        yield
    finally:
        vllm_generation.VLLMClient = trl_client


class MergedLoraSync:
    """Replacement for ``VLLMGeneration.sync_weights`` on one TRL generation object (see the module docstring).

    Args:
        generation: the trainer's ``trl.generation.vllm_generation.VLLMGeneration`` (``trainer.vllm_generation``);
            its ``model`` must be a peft model with one active plain-LoRA adapter, unsharded or FSDP2-sharded.
        dtype: dtype of the pushed tensors; default: the engine's (colocate) or the trainer's (server, as TRL).
        backend: server mode: the server's weight-transfer backend; ``"lora_merge"`` sends the factors only.

    ``last_sync_bytes``: what the last server sync sent (main process; None before it, and in colocate mode).
    """

    def __init__(self, generation, dtype: torch.dtype | None = None, backend: str | None = None):
        self.generation = generation
        self.dtype = dtype
        self.backend = backend
        self.server_metadata: list[tuple[str, str, list[int]]] | None = None
        self.transfer = None  # lora_merge: this process's LoraMergeTrainer (the main process's connects at first)
        self.syncs = 0
        self.last_sync_bytes: int | None = None

    def __call__(self) -> None:
        from trl.generation.vllm_generation import empty_cache

        from merge.lora_merge import BACKEND

        gen = self.generation
        check_fsdp2_layout(gen.model)  # accelerate shards at train(), after installation: checked on every sync
        if gen.mode == "colocate" and gen.enable_sleep_mode:  # TRL's preamble, as is
            empty_cache()
            gen.llm.wake_up(tags=["weights"])
            gen._llm_weights_sleeping = False
        self.syncs += 1
        if gen.mode == "server":
            if self.backend == BACKEND:
                self._send_factors()
            else:
                self._push_to_server()
            if gen.accelerator.is_main_process:
                url = gen.vllm_client.base_url
                _on_server(url, "resetting its prefix cache", gen.vllm_client.reset_prefix_cache)
        else:
            push_merged_lora_to_llm(gen.model, gen.llm, self.dtype)

    def _push_to_server(self) -> None:
        gen = self.generation
        if self.server_metadata is None:  # the server must know every tensor before the first is broadcast
            self.server_metadata = [
                (name, str(t.dtype).removeprefix("torch."), list(t.shape))
                for name, t in merged_lora_weights(gen.model, self.dtype)
            ]
        weights = merged_lora_weights(gen.model, self.dtype)
        if gen.accelerator.is_main_process:
            gen.vllm_client.update_named_params(self.server_metadata, weights)
            self.last_sync_bytes = sum(
                torch.Size(shape).numel() * getattr(torch, dtype).itemsize for _, dtype, shape in self.server_metadata
            )
        else:
            for _ in weights:  # take part in the unshard collectives
                pass

    def _send_factors(self) -> None:
        """The ``lora_merge`` sync: every process gathers the factors (a collective under FSDP2), the main process
        sends them; the server serves ``W_base + scale * B @ A`` as weight version ``syncs`` once this returns."""
        from merge.lora_merge import LoraMergeTrainer, LoraMergeTrainerInitInfo, WeightTransferError

        gen = self.generation
        if not gen.accelerator.is_main_process:
            if self.transfer is None:
                info = LoraMergeTrainerInitInfo(rank=gen.accelerator.process_index)
                self.transfer = LoraMergeTrainer(client=None, init_info=info)
            self.transfer.send_weights(gen.model)
            return
        client = gen.vllm_client
        url = client.base_url
        if self.transfer is None:  # one group: the main process and every worker of the server
            workers = _on_server(url, "reporting its workers", client.get_world_size)
            transport = "nccl" if torch.cuda.is_available() else "gloo"
            self.transfer = LoraMergeTrainer.connect(
                url, rank=0, num_workers=workers, transport=transport, precision_stats=False
            )
        try:
            _on_server(url, "taking a weight sync", self.transfer.send_weights, gen.model, str(self.syncs))
        except TRLServerError:
            raise
        except WeightTransferError as error:  # e.g. a server holding another model: the tensor is named
            raise TRLServerError(f"weight sync to {url} refused: {' '.join(str(error).split())}") from None
        except RuntimeError as error:  # the group broke mid-send (gloo: "Connection closed by peer")
            text = " ".join(str(error).split())[:200]
            what = f"closed the weight transfer during a sync (gone, or another trainer took it: {text})"
            raise _gone(url, what) from None
        self.last_sync_bytes = int(self.transfer.last_sync["sync_bytes"])


def use_merged_lora_sync(trainer, dtype: torch.dtype | None = None) -> MergedLoraSync:
    """Make ``trainer`` (a TRL 1.16 ``GRPOTrainer`` with ``use_vllm=True`` and a peft LoRA model) sync vLLM with
    merged LoRA weights instead of ``merge_adapter()``/``unmerge_adapter()``; returns the installed sync.

    Call it after building the trainer and before ``train()``; calling it again returns the installed sync. In
    server mode it is a collective (every process calls it): the main process asks the server for its backend;
    against ``lora_merge`` (trainer built inside :func:`lora_merge_server_client`) only the factors travel.
    Raises :class:`UnsupportedTRLVersionError` for TRL outside :data:`SUPPORTED_TRL`, ``ValueError`` without vLLM,
    ``merge.UnsupportedAdapterError`` for adapters ``merged_lora_params`` cannot merge (DoRA, several adapters...)
    or, against ``lora_merge``, that train more than LoRA factors, and :class:`TRLServerError` for a server
    without a weight-transfer backend.
    """
    check_trl_version()
    if not getattr(trainer, "use_vllm", False):
        raise ValueError(f"{type(trainer).__name__} does not generate with vLLM (use_vllm=False): nothing to sync")
    return install_merged_lora_sync(trainer.vllm_generation, dtype)


def _shared_server_backend(generation) -> str | None:
    """The server's backend, asked by the main process (the only one with a client) and shared with every process;
    a refusal there is raised on every process."""
    from accelerate.utils import broadcast_object_list

    answer: str | None | TRLServerError = None
    if generation.accelerator.is_main_process:
        client = generation.vllm_client
        try:
            if not hasattr(client, "weight_transfer_backend"):  # built outside lora_merge_server_client
                client.weight_transfer_backend = server_backend(client)
            answer = client.weight_transfer_backend
            if answer is None:
                answer = _refuse_no_backend(client.base_url)
        except TRLServerError as error:
            answer = error
    shared = broadcast_object_list([answer], from_process=0)[0]
    if isinstance(shared, TRLServerError):
        raise shared
    return shared


def refuse_non_lora_training(model) -> None:
    """The ``lora_merge`` server receives LoRA factors only: any other trained tensor (``modules_to_save``,
    trainable tokens) would never reach it, so it is refused, naming the first few."""
    from merge import UnsupportedAdapterError
    from merge.lora_merge import BACKEND

    other = [name for name, p in model.named_parameters() if p.requires_grad and "lora_" not in name]
    if other:
        raise UnsupportedAdapterError(
            f"the {BACKEND} server receives LoRA factors only, but the model also trains {len(other)} other "
            f"tensor(s) ({', '.join(other[:3])}): drop modules_to_save / trainable tokens, or sync through a server "
            """with vLLM's '{"backend": "nccl"}', which takes the merged weights"""
        )


def install_merged_lora_sync(generation, dtype: torch.dtype | None = None) -> MergedLoraSync:
    """:func:`use_merged_lora_sync` on a ``VLLMGeneration`` directly (for code that builds one without a trainer)."""
    from trl.generation.vllm_generation import VLLMGeneration

    from merge.lora_merge import BACKEND

    check_trl_version()
    if not isinstance(generation, VLLMGeneration):
        raise TypeError(f"expected trl's VLLMGeneration, got {type(generation).__name__}")
    if isinstance(generation.sync_weights, MergedLoraSync):
        return generation.sync_weights
    check_supported(generation.model)  # fail now, not at the first rollout
    check_fsdp2_layout(generation.model)
    backend = None
    if generation.mode == "server":
        backend = _shared_server_backend(generation)
        if backend == BACKEND:
            refuse_non_lora_training(generation.model)
            _watch_generation(generation)
    generation.sync_weights = MergedLoraSync(generation, dtype, backend)
    return generation.sync_weights


def _watch_generation(generation) -> None:
    """TRL's ``vllm_client.generate`` (main process), on that instance, with the server's failures as one line and
    its health watched (TRL's ``vllm_server_timeout``: how long /health may fail before the run stops)."""
    if not generation.accelerator.is_main_process:
        return
    client = generation.vllm_client
    generate = client.generate

    def generate_watched(*args, **kwargs):
        call = lambda: generate(*args, **kwargs)  # noqa: E731
        return _watching_health(client.base_url, "generating", call, generation.server_timeout)

    client.generate = generate_watched


@contextlib.contextmanager
def vllm_engine_kwargs(**engine_kwargs):
    """Build TRL's colocate engine as ``LLM(**trl_kwargs, **engine_kwargs)`` while the block runs.

    TRL 1.16 constructs ``LLM(...)`` inside ``VLLMGeneration._init_vllm`` from a fixed set of arguments; this
    swaps the name ``LLM`` in ``trl.generation.vllm_generation`` for the block only (restored on exit), so the
    engine gets e.g. ``dtype="float32"``, ``kv_cache_memory_bytes=...``, ``enforce_eager=True``. Ours override
    TRL's where both set one. Version-pinned like the rest of this module.

        with vllm_engine_kwargs(dtype="float32", kv_cache_memory_bytes=2**28, enforce_eager=True):
            trainer = GRPOTrainer(...)
    """
    import trl.generation.vllm_generation as vllm_generation

    check_trl_version()
    trl_llm = vllm_generation.LLM

    def build_llm(*args, **kwargs):
        return trl_llm(*args, **{**kwargs, **engine_kwargs})

    vllm_generation.LLM = build_llm
    try:
        yield
    finally:
        vllm_generation.LLM = trl_llm
