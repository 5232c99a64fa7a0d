"""The core sections of `justapi serve`'s configuration: frozen dataclasses, one per concern,
validated in __post_init__; each field's one default and help text are in its `option()`.

Each component receives only its slice. Values found at run time (how many blocks a worker
could allocate) travel in messages, never by mutating these objects.
Owns: these sections' fields, defaults and validation. Does not own: the other sections (ops.py,
pd.py, spec.py, cluster.py), loading (serve.py) or the flags (flags.py).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from justapi.config.fields import ConfigError as ConfigError
from justapi.config.fields import check_bool, check_choice, check_number, option, require
from justapi.model.info import GGUF_SAMPLING_KEYS
from justapi.sampling import BUILTIN_SAMPLING_DEFAULTS, SamplingParams
from justapi.wire import transport
from justapi.wire.protocol import MAX_DECODE_STEPS

POLICIES = ("fcfs", "priority", "lpm")
DEVICES = ("cpu", "cuda")
WEIGHT_MODES = ("fp32", "bf16", "q4", "auto")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")
AUTO_KV_CACHE_DTYPE = {"cpu": "float16", "cuda": "bfloat16"}
"""What `--kv-cache-dtype auto` is per device (the measurements behind it: docs/runtime.md)."""
LAUNCHERS = ("local", "ray")
LOG_LEVELS = ("debug", "info", "warning", "error")
REASONING_PARSERS = ("auto", "none", "qwen3", "deepseek_r1")
"""--reasoning-parser (justapi/frontend/reasoning/formats.py PARSER_CHOICES)."""
POOLING_CHOICES = ("auto", "none", "last", "mean", "cls")
MATRYOSHKA_CHOICES = ("auto", "on", "off")


@dataclass(frozen=True)
class CacheConfig:
    """KV memory: how the pool is cut into blocks."""

    block_size: int = option(16, "Tokens per KV block (a power of two).")
    pool_blocks: int = option(0, "KV blocks per device pool; 0 sizes the pool from available "
                                 "memory (kv-memory-fraction).")
    kv_memory_fraction: float = option(0.25, "With pool-blocks 0: the fraction of free memory "
                                             "(RAM on CPU, GPU memory on CUDA) the KV pool takes.")
    enable_prefix_cache: bool = option(
        True, "Share the cached KV blocks of identical prompt prefixes between requests "
              "(radix tree).", decls=("--prefix-cache/--no-prefix-cache",))
    kv_cache_dtype: str = option(
        "auto", "KV cache element type. auto: float16 on CPUs (llama-server's default cache: 11 "
                "significant bits where bfloat16 keeps 8, as fast here), bfloat16 on GPUs (their "
                "forward computes in bf16). A 16-bit CPU pool holds twice the blocks of an fp32 "
                "one in the same memory and its attention reads half the bytes; K/V are rounded "
                "as they are stored (docs/runtime.md). float32: the exact cache, CPU only.",
        choices=KV_CACHE_DTYPES)

    def pool_dtype(self, device: str) -> str:
        """The pool's dtype name (workers/kv/pool.py) for workers on `device` ("cpu", "cuda");
        ConfigError for float32 on a GPU."""
        require(device == "cpu" or self.kv_cache_dtype != "float32",
                "kv-cache-dtype float32 is CPU only (GPU workers attend in bf16): use auto, "
                "bfloat16 or float16")
        if self.kv_cache_dtype == "auto":
            return AUTO_KV_CACHE_DTYPE["cpu" if device == "cpu" else "cuda"]
        return self.kv_cache_dtype

    def __post_init__(self) -> None:
        check_number(self.block_size, "block-size", low=1, integer=True)
        require(self.block_size <= 1024 and self.block_size & (self.block_size - 1) == 0,
                f"block-size must be a power of two <= 1024, got {self.block_size!r}")
        check_number(self.pool_blocks, "pool-blocks", low=0, integer=True)
        check_number(self.kv_memory_fraction, "kv-memory-fraction", above=0.0, high=0.95)
        check_bool(self.enable_prefix_cache, "enable-prefix-cache")
        check_choice(self.kv_cache_dtype, "kv-cache-dtype", KV_CACHE_DTYPES)


@dataclass(frozen=True)
class SchedulerConfig:
    """Batching budgets and policy of the scheduler core."""

    max_seqs: int = option(32, "Most requests in one step.")
    max_prefill: int = option(4, "Most requests mid-prefill in one step.")
    max_decode: int = option(32, "Most decoding requests in one step.")
    chunk_size: int = option(512, "Most prompt tokens computed for one request in one step "
                                  "(chunked prefill).")
    max_batched_tokens: int = option(2048, "Token budget of one step (all requests' chunks "
                                           "together).")
    itl_target_ms: float = option(
        -1.0, "Stall-free batching: a step that decodes carries prefill chunks only up to this "
              "step time, from the worker's measured step costs; prefills go fewest remaining "
              "tokens first. -1 (auto): prefill up to 5x the step's decode time; 0: off (every "
              "step takes max-batched-tokens, oldest prefill first).")
    policy: str = option("fcfs", "Waiting-queue order: fcfs, priority, or lpm (longest cached "
                                 "prefix first). priority (vLLM's --scheduling-policy priority): a "
                                 "request's `priority` field orders the queue, lower first, and a "
                                 "waiting request preempts running ones of a lower priority when "
                                 "it lacks a seat or KV blocks.", choices=POLICIES,
                         decls=("--policy", "--scheduling-policy"))
    scheduled: bool = option(True, "Continuous batching; --no-scheduled: static batching (a "
                                   "batch runs until all of it finishes; the benchmark baseline).")
    lpm_max_waiting: int = option(128, "lpm orders by cached prefix only while at most this many "
                                       "requests wait; above, FCFS.")
    lpm_max_wait_steps: int = option(256, "lpm: a request waiting more steps than this is "
                                          "admitted first (FCFS), so none starves.")
    route_balance_abs: int = option(8, "Routing: the pool with the longest cached prefix is "
                                       "skipped when its load exceeds the lightest pool's by more "
                                       "than this many requests per worker (and by "
                                       "route-balance-rel).")
    route_balance_rel: float = option(1.5, "...and by more than this factor (SGLang's "
                                           "cache-aware balance thresholds).")
    overlap: bool = option(True, "Plan a worker's next step while its current one runs, so it "
                                 "starts as soon as that is done (not with speculative decoding, "
                                 "nor on PD prefill workers; local CPU workers only when their threads leave a core "
                                 "free); --no-overlap: one step at a time.",
                           decls=("--overlap/--no-overlap",))
    decode_steps: int = option(-1, "Multi-step decoding: a plan whose chunks are all single-token "
                                   "decodes runs up to this many steps on the worker without a "
                                   "round trip (tokens reach clients this many at a time; "
                                   "fewer where the steps would take over ~50 ms). -1 "
                                   "(auto): 4 where local CPU workers' threads take every core "
                                   "(no overlap there), else 1 (off).")

    def __post_init__(self) -> None:
        for name in ("max_seqs", "max_prefill", "max_decode", "chunk_size", "max_batched_tokens",
                     "lpm_max_waiting", "lpm_max_wait_steps", "route_balance_abs"):
            check_number(getattr(self, name), name.replace("_", "-"), low=1, integer=True)
        check_choice(self.policy, "policy", POLICIES)
        check_bool(self.scheduled, "scheduled")
        check_bool(self.overlap, "overlap")
        check_number(self.decode_steps, "decode-steps", low=-1, high=MAX_DECODE_STEPS, integer=True)
        require(self.decode_steps != 0, "decode-steps must be -1 (auto) or a number of steps >= 1, "
                                        "got 0")
        check_number(self.itl_target_ms, "itl-target-ms", low=-1.0)
        require(self.itl_target_ms == -1 or self.itl_target_ms >= 0, "itl-target-ms must be -1 "
                f"(auto), 0 (off) or a number of milliseconds > 0, got {self.itl_target_ms!r}")
        check_number(self.route_balance_rel, "route-balance-rel", low=1.0)


@dataclass(frozen=True)
class ModelConfig:
    """Which model and how the worker holds it."""

    model: str = option("", "GGUF file (none: the embedded SmolLM2-135M-Instruct), or "
                            "synthetic:layers=2,hidden=64,... for random weights.")
    device: str = option("cpu", 'Run the workers on CUDA GPUs, one per GPU (TOML: device = '
                                '"cuda").',
                         decls=("--gpu",), flag_value="cuda", choices=DEVICES)
    weights: str = option("auto", "auto: keep the GGUF blocks, each step's kernel from a plan "
                                  "measured at start-up (CPUs with AVX2; elsewhere fp32); fp32: "
                                  "dequantize at load; bf16: the same, multiplied in bf16 on CPUs "
                                  "with AVX512-BF16/AMX; q4: 4-bit planes (int4 kernels) where "
                                  "exact.",
                          choices=WEIGHT_MODES)
    max_context: int = option(0, "Cap on the model's context length; 0 takes the model's own.")
    batch_invariant: bool = option(
        False, "CPU: compute every row alike whatever shares its step and however its prompt "
               "was chunked (greedy output independent of the load; a restart continues "
               "exactly), at a cost: --weights auto plans choose among the int8 block kernels "
               "only, and every chunk is attended by the decode kernel (long prompts prefill "
               "~10-20% slower on AVX-512, more on an fp32 pool). As vLLM's "
               "VLLM_BATCH_INVARIANT and SGLang's --enable-deterministic-inference.")
    allow_unused_tensors: bool = option(
        False, "Load a GGUF even where it holds tensors the loader does not read (each named in a "
               "warning). For experiments: such a file is a variant the model code does not know, "
               "and its output is likely wrong. Without it the file is refused, naming them.",
        decls=("--allow-unused-tensors",))
    cuda_graphs: bool = option(True, "GPU: replay decode (and uniform verification) steps from "
                                     "CUDA graphs captured per batch size at start; "
                                     "--no-cuda-graphs launches each kernel from Python.")
    pooling: str = option("auto", "/v1/embeddings: how a prompt's hidden states become one "
                                  "vector. auto: the GGUF's pooling_type (a file without one "
                                  "serves no embeddings); last, mean, cls: that pooling (as "
                                  "llama-server's --pooling); none: no embeddings.",
                          choices=POOLING_CHOICES)
    matryoshka: str = option("auto", "/v1/embeddings `dimensions` (a Matryoshka-trained model's "
                                     "leading dimensions, renormalized). auto: on for the "
                                     "Qwen3-Embedding family (trained so), else off, where only "
                                     "the full size is accepted.",
                             choices=MATRYOSHKA_CHOICES)

    def __post_init__(self) -> None:
        check_choice(self.pooling, "pooling", POOLING_CHOICES)
        check_choice(self.matryoshka, "matryoshka", MATRYOSHKA_CHOICES)
        check_choice(self.device, "device", DEVICES)
        check_choice(self.weights, "weights", WEIGHT_MODES)
        check_number(self.max_context, "max-context", low=0, integer=True)
        check_bool(self.cuda_graphs, "cuda-graphs")
        check_bool(self.allow_unused_tensors, "allow-unused-tensors")
        check_bool(self.batch_invariant, "batch-invariant")
        if self.batch_invariant and self.device != "cpu":
            raise ConfigError("--batch-invariant is for CPU workers: the GPU's kernels sum in "
                              "an order that depends on the batch")


@dataclass(frozen=True)
class ServerConfig:
    """The process pool and its endpoints."""

    host: str = option("127.0.0.1", "HTTP bind address (loopback unless told otherwise).")
    port: int = option(8000, "HTTP port; 0 picks a free one.")
    zmq: str = option("", "Endpoint of the ZMQ client API, e.g. tcp://127.0.0.1:5555 (none: an "
                          "ipc socket in the runtime dir).")
    workers: int = option(1, "Worker processes (one per GPU with --gpu; CPU workers share the "
                             "cores).")
    threads: int = option(0, "torch threads of each CPU worker; 0: the cores divided among the "
                             "workers (with --pd: all of them for prefill, one per decode worker).")
    cpu_spin: int = option(-1, "CPU workers: GOMP_SPINCOUNT of an OpenMP thread waiting at a "
                               "barrier (10000 is about 0.1-0.3 ms); 0: it sleeps at once; -1 "
                               "(auto): 10000, or 0 for tiny models and where the workers' "
                               "threads outnumber the cores.")
    control_nice: int = option(-1, "Niceness of the frontend and the scheduler (0-19: the higher, "
                                   "the sooner they yield a core to a CPU worker's threads); -1 "
                                   "(auto): 10 where local CPU workers' threads take every core, "
                                   "else 0.")
    served_model_name: str = option("", "Model id shown by /v1/models (none: the GGUF's name).")
    ready_timeout_s: float = option(120.0, "How long start-up waits for each process's Ready.")
    launcher: str = option("local", "Where workers run: local processes, or Ray actors on the "
                                    "nodes of a Ray cluster (docs/scale-out.md).",
                           choices=LAUNCHERS)
    log_level: str = option("info", "Log level of every process.", choices=LOG_LEVELS)
    max_request_bytes: int = option(4 << 20, "HTTP request bodies larger than this get 413.")
    max_queue: int = option(1024, "Requests admitted beyond what the workers run at once "
                                  "(max-seqs x workers); past that new requests get 429 with "
                                  "Retry-After.")
    shutdown_grace_s: float = option(30.0, "On SIGTERM, requests in flight get this long to "
                                           "finish (new ones get 503).")
    log_requests: bool = option(False, "Log each request's prompt and parameters (off: prompt "
                                       "text never reaches the logs).")
    zmq_curve_secret_key: str = option(
        "", "File with the z85 CURVE secret key of the ZMQ client endpoint (needed for tcp "
            "beyond loopback; `justapi keys` makes one).", is_path=True)
    reasoning_parser: str = option("auto", "How replies of a reasoning model are split into "
                                           "reasoning_content and content: auto (from the chat "
                                           "template: <think> for Qwen3 / DeepSeek-R1), a family, "
                                           "or none (thinking stays in the content).",
                                   choices=REASONING_PARSERS)

    def __post_init__(self) -> None:
        check_number(self.port, "port", low=0, high=65535, integer=True)
        check_number(self.workers, "workers", low=1, high=64, integer=True)
        check_number(self.threads, "threads", low=0, high=1024, integer=True)
        check_number(self.cpu_spin, "cpu-spin", low=-1, high=10**9, integer=True)
        check_number(self.control_nice, "control-nice", low=-1, high=19, integer=True)
        check_number(self.ready_timeout_s, "ready-timeout-s", above=0.0)
        check_choice(self.launcher, "launcher", LAUNCHERS)
        check_choice(self.log_level, "log-level", LOG_LEVELS)
        check_number(self.max_request_bytes, "max-request-bytes", low=1024, integer=True)
        check_number(self.max_queue, "max-queue", low=0, integer=True)
        check_number(self.shutdown_grace_s, "shutdown-grace-s", low=0.0)
        check_bool(self.log_requests, "log-requests")
        check_choice(self.reasoning_parser, "reasoning-parser", REASONING_PARSERS)
        require(not self.zmq.startswith("tcp://") or transport.is_loopback_endpoint(self.zmq)
                or bool(self.zmq_curve_secret_key),
                f"zmq {self.zmq} is reachable beyond this host: it needs CURVE encryption, "
                "give --zmq-curve-secret-key FILE (make a pair with `justapi keys`)")


def _sampling_help(name: str, what: str) -> str:
    return (f"{what} of requests that leave it out; a request's own value wins. Default: the "
            f"GGUF's {GGUF_SAMPLING_KEYS[name]}, else {BUILTIN_SAMPLING_DEFAULTS[name]:g} "
            "(llama-server's).")


@dataclass(frozen=True)
class SamplingConfig:
    """The server's sampling defaults: what a request that leaves a field out gets. None here:
    the model's own (its GGUF's general.sampling.*), else llama-server's (justapi/sampling.py)."""

    temperature: float | None = option(None, _sampling_help("temperature", "Temperature (0: "
                                                            "greedy)"),
                                       decls=("--temperature", "--temp"))
    top_k: int | None = option(None, _sampling_help("top_k", "top-k (0: off)"))
    top_p: float | None = option(None, _sampling_help("top_p", "top-p"))
    min_p: float | None = option(None, _sampling_help("min_p", "min-p (0: off)"))
    repetition_penalty: float | None = option(
        None, _sampling_help("repetition_penalty", "Repetition penalty (1: off)"),
        decls=("--repetition-penalty", "--repeat-penalty"))

    def __post_init__(self) -> None:
        given: dict[str, Any] = self.given()
        try:
            SamplingParams(**given)  # the one place that knows each field's range
        except ValueError as exc:
            message = str(exc)
            for name in given:
                message = message.replace(f"{name} must", f"{name.replace('_', '-')} must")
            raise ConfigError(message) from None

    def given(self) -> dict[str, float]:
        """The defaults set here (flag or TOML), by SamplingParams field name."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) is not None}
