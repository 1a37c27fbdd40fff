"""The wire contract between the service and the worker process.

Both sides import this module and nothing else of each other. Messages are plain
dicts of JSON types, framed as a 4-byte big-endian length followed by an orjson body,
over one stream socket (a socketpair created by the service).

Conversation:
    service -> worker   {"type": "init", **WorkerConfig}
    worker  -> service  {"type": "ready", **Handshake}        or {"type": "fatal", "message": ...}
    service -> worker   {"type": "step", **StepPlan}          (repeated)
    worker  -> service  {"type": "result", **StepResult}      (one per step, in order)
                     or {"type": "fatal", "reason": ..., "message": ...}, then exits
                        (reason: DEVICE_ERROR, RANK_LOST or RANK_HUNG)
    service -> worker   {"type": "ping"}                      (only while no step is out)
    worker  -> service  {"type": "pong"}
    service -> worker   {"type": "shutdown"}                  worker exits 0

An exception inside a step is reported as a StepResult with `error` set; the worker
keeps serving. Only a failure that leaves the worker unusable is "fatal": at init, or a
step's device error or a tensor-parallel rank lost (gpu_worker.faults), after which the
worker exits and the service starts a new one.

With --tensor-parallel-size N the worker is rank 0 of a group (gpu_worker.worker_group);
the service sees one worker and this one conversation.

The service sends the next step as soon as it has the previous result (at most one step
is out at a time), so the worker idles only for the gap between the two; each result
reports that gap as `idle_ms`.
"""

from __future__ import annotations

import dataclasses
import struct
from dataclasses import dataclass, field
from typing import Any

HEADER = struct.Struct(">I")
# The model families the worker runs: Hugging Face model_type -> architecture class. The
# service checks model files against this before it starts a worker.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",  # its text model only (text_config)
    "phi3": "Phi3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "gemma4_text": "Gemma4ForCausalLM",
    "gemma4": "Gemma4ForConditionalGeneration",  # its text model only (text_config)
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",  # its text model only (text_config)
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",  # its text model only
}
MAX_FRAME_BYTES = 256 * 1024 * 1024
# A longer wait for a plan is the service having no work, not the cost of preparing a step.
MAX_IDLE_GAP_S = 1.0
DEVICE_ERROR = "device_error"  # a step's "fatal" reason: the device is unusable
# a tensor-parallel group's "fatal" reasons: a rank exited, or stopped answering
RANK_LOST, RANK_HUNG = "rank_lost", "rank_hung"
KERNEL_SEAMS = ("attention", "layer_ops", "matmul")  # see gpu_worker.kernels
POOL_LAST, POOL_SUM = "last", "sum"  # NewSeq.pooling's kinds
# Beside model.safetensors in a GGUF conversion: each matmul weight as the file quantized it,
# <name>.values (int8: q8, uint8: q4 or q5), <name>.scales and <name>.mins (gpu_worker.quant)
QUANTIZED_WEIGHTS = "quantized.safetensors"
# WorkerConfig.quantization's values (gpu_worker.quant)
QUANTIZATIONS = ("none", "int8", "int4", "gguf")
# A drafted token the worker's draft model is to choose (Row.drafts)
DRAFT_MODEL_TOKEN = -1
# WorkerConfig.kv_transfer_engine's values: Mooncake's transfer engine, or the in-process
# one of the unit tests (gpu_worker.kv_connector_local)
KV_ENGINE_MOONCAKE, KV_ENGINE_LOCAL = "mooncake", "local"


BLOCK_SIZE = 16
# FlexAttention's key tiles are one block wide at most: a block of 16 makes 16-key tiles,
# too short to keep a GPU's loads in flight.
CUDA_BLOCK_SIZE = 64


def block_size_for(requested: int | None, device_type: str) -> int:
    """The KV block size a worker on `device_type` uses: the one asked for, or its default."""
    if requested is not None:
        return requested
    return CUDA_BLOCK_SIZE if device_type == "cuda" else BLOCK_SIZE


@dataclass(slots=True)
class WorkerConfig:
    """What a worker is started with. Its defaults are the server's (service.config.Config
    takes its worker fields' defaults from here)."""

    model_dir: str  # a Hugging Face style directory (GGUF files are converted to one first)
    dtype: str = "bfloat16"  # "float32" | "bfloat16"
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    block_size: int | None = None  # None: the device's (block_size_for)
    kv_memory: float = 0.25  # <= 1.0: fraction of free device memory; > 1.0: bytes
    max_num_seqs: int = 128  # largest decode batch; bounds the graph buckets
    max_num_batched_tokens: int = 512  # largest flattened step the worker must accept
    seed: int = 0
    use_cuda_graphs: bool = True
    kv_cache_dtype: str = "auto"  # "auto" (the model's dtype) | "int8" | "fp8"
    kernels: str = "auto"  # "auto", or pins: "attention=native,matmul=onednn" (kernel_choice)
    kernel_cache: str | None = None  # JSON file of measured kernel choices; None: measure
    # the matmuls' weights (gpu_worker.quant): "none" (dtype), "int8" or "int4" (quantized
    # at load), "gguf" (a GGUF conversion's own quantized weights, QUANTIZED_WEIGHTS)
    quantization: str = "none"
    # speculative decoding with a draft model (gpu_worker.draft_model): its directory, and
    # its weights' quantization (as `quantization`, but never "gguf" unless it has them)
    draft_model_dir: str | None = None
    draft_quantization: str = "none"
    # ranks splitting the model (gpu_worker.worker_group), and how long one rank's collective
    # may wait for the others before the group is put down (under the service's step timeout)
    tensor_parallel_size: int = 1
    collective_timeout: float = 15.0
    # where the group's store listens (HOST:PORT; None: loopback, any free port), and how
    # many ranks rank 0 starts on its host (None: all); the others join from elsewhere
    tensor_parallel_address: str | None = None
    tensor_parallel_size_local: int | None = None
    # threads of a CPU rank's model work (None: the cores it may run on, shared among the
    # host's ranks); fewer leave cores to the front end
    cpu_threads: int | None = None
    # disaggregated prefill and decode (gpu_worker.kv_connector): the transfer engine that
    # serves this worker's cache to consumers and pulls from producers (None: none, or
    # KV_ENGINE_MOONCAKE), the host it listens on, and the seconds a pull may take (the
    # engine gives up on a peer that hangs then, and lets go of the blocks it wrote)
    kv_transfer_engine: str | None = None
    kv_transfer_host: str = "127.0.0.1"
    kv_transfer_timeout: float = 30.0
    # a producer's staging arena (gpu_worker.kv_staging), in tokens of K/V (rounded up to
    # blocks; tokens, not blocks, as the block size differs by device): a held prompt
    # gathered into one region that a consumer reads in one segment; 0: none
    kv_staging_tokens: int = 8192
    # LoRA adapters (gpu_worker.lora): slots held at once (0: LoRA off), and the largest
    # rank a slot holds (its buffers are allocated at start for every target module)
    max_loras: int = 0
    max_lora_rank: int = 16


def parse_kernel_pins(text: str) -> dict[str, str]:
    """ "auto" -> {}; "attention=torch,matmul=aten" -> those pins; ValueError otherwise."""
    if text.strip() == "auto":
        return {}
    pins = {}
    for part in text.split(","):
        seam, sep, name = (piece.strip() for piece in part.partition("="))
        if not sep or seam not in KERNEL_SEAMS or not name.replace("-", "").isalnum():
            raise ValueError(
                f"kernels must be 'auto' or SEAM=NAME pairs separated by commas, with SEAM one "
                f"of {', '.join(KERNEL_SEAMS)}; got {text!r}"
            )
        pins[seam] = name
    return pins


@dataclass(slots=True)
class Handshake:
    model_name: str
    architecture: str
    vocab_size: int
    max_model_len: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    device: str
    block_size: int
    num_blocks: int
    kv_bytes: int
    kv_cache_dtype: str  # the cache tensors' dtype: "bfloat16", "int8", "float8_e4m3fn", ...
    decode_buckets: list[int]
    pid: int
    load_seconds: float
    # gpu_worker.kernel_choice's report: the kernel chosen for each seam, every
    # candidate's measured time or failure, and whether the choice came from the cache.
    kernels: dict[str, Any] = field(default_factory=dict)
    # gpu_worker.graphs' start-up capture: graphs captured, shapes that failed (served
    # eagerly), seconds taken, and the block-table widths covered.
    graphs: dict[str, Any] = field(default_factory=dict)
    # the steps run before the handshake to compile every shape class (gpu_worker.warm_up)
    warm_up: dict[str, Any] | None = None
    # why the worker serves on the CPU although a GPU is visible (gpu_worker.device)
    device_warning: str | None = None
    # seconds per start-up step, in order (gpu_worker.runtime); load_seconds is their sum
    startup: dict[str, float] = field(default_factory=dict)
    # the cache's groups of layers (gpu_worker.kv_groups), each one's sliding window (a
    # query at p sees keys p - w + 1 .. p) or None for full attention: the service keeps a
    # table per group and frees a windowed group's blocks behind its window
    kv_group_windows: list[int | None] = field(default_factory=lambda: [None])
    # the bytes one sequence's recurrent-state slot holds (gpu_worker.recurrent_state: the
    # linear-attention layers' conv and recurrent states); 0: the model has none
    recurrent_state_bytes: int = 0
    # WorkerConfig.quantization, and which kernel serves the quantized weights
    quantization: str = "none"
    # the draft model's directory name (WorkerConfig.draft_model_dir), None without one
    draft_model: str | None = None
    # each rank of the group, rank 0 first: {"rank", "pid", "device", "kv_bytes"} (one entry
    # without tensor parallelism); kv_bytes above is their sum. With a KV transfer engine
    # each also has its own "kv_transfer_address" and "kv_tensor_addresses" (below: rank 0's)
    ranks: list[dict[str, Any]] = field(default_factory=list)
    # with a KV transfer engine (WorkerConfig.kv_transfer_engine): where it listens
    # (host:port), and the base address of each cache tensor it registered, in
    # gpu_worker.kv_connector.cache_tensors' order (a KvPull's remote_tensors)
    kv_transfer_address: str | None = None
    kv_tensor_addresses: list[int] = field(default_factory=list)
    # one block's bytes over every cache tensor and KV head (what a pull moves a block), and
    # the staging arena (WorkerConfig.kv_staging_tokens): its address and its blocks (0: none)
    kv_block_bytes: int = 0
    kv_staging_address: int | None = None
    kv_staging_blocks: int = 0


@dataclass(slots=True)
class SamplingSpec:
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    seed: int | None = None  # seeded requests sample reproducibly whatever their batch
    logprobs: bool = False  # the chosen token's log-probability
    top_logprobs: int = 0  # with logprobs: the k most likely tokens at each sampled position
    # the prompt's tokens' log-probabilities, each with this many alternatives (`echo`)
    prompt_logprobs: int | None = None
    # Logit processors, as vLLM's (gpu_worker.logit_processors), applied in this order:
    # tokens outside allowed_token_ids (None: all allowed) and bad words at -inf; until
    # min_tokens tokens are generated, min_tokens_stop_ids (the request's stop_token_ids,
    # and EOS unless ignore_eos: the service fills them in) at -inf; logit_bias as
    # [token, bias] pairs; the penalties; then (sampled rows only, after temperature) min_p.
    allowed_token_ids: list[int] | None = None
    # token sequences: the last token is banned where the generated tokens end with the rest
    bad_words: list[list[int]] = field(default_factory=list)
    min_tokens: int = 0
    min_tokens_stop_ids: list[int] = field(default_factory=list)
    logit_bias: list[tuple[int, float]] = field(default_factory=list)
    presence_penalty: float = 0.0  # per generated token seen
    frequency_penalty: float = 0.0  # per occurrence among the generated tokens
    repetition_penalty: float = 1.0  # on tokens of the prompt or generated: 1 is none
    min_p: float = 0.0

    @property
    def reads_history(self) -> bool:
        """Whether sampling depends on the sequence's tokens so far: the worker then keeps
        them (NewSeq.prefix)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.bad_words
            or self.min_tokens
        )

    @property
    def adjusts_logits(self) -> bool:
        """Whether a processor before temperature (all but min_p) applies to this row."""
        return self.allowed_token_ids is not None or bool(self.logit_bias) or self.reads_history


@dataclass(slots=True)
class TokenLogprobs:
    """Log-probabilities at consecutive positions of one sequence, in float32 from the raw
    logits: each position's token (the sampled one, or the prompt's next), and its
    alternatives, most likely first (as many as the SamplingSpec asked for)."""

    logprobs: list[float] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)

    def extend(self, other: TokenLogprobs) -> None:
        self.logprobs += other.logprobs
        self.top_ids += other.top_ids
        self.top_logprobs += other.top_logprobs

    def __len__(self) -> int:
        return len(self.logprobs)


@dataclass(slots=True)
class NewSeq:
    """A sequence the worker does not hold yet, sent once: with the first plan that runs it,
    and again after each preemption (the plan that preempted it lists it in `finished`) or
    on a new worker. The worker keeps these facts (gpu_worker.seq_table) until a plan's
    `finished` names the sequence."""

    seq_id: int
    sampling: SamplingSpec
    prompt_len: int  # tokens at positions from here on are generated
    # the tokens before its first row's start_pos (a prefix-cache hit), sent only when its
    # sampling reads its history (SamplingSpec.reads_history): the worker counts every
    # token a row computes from then on, so no later plan carries a token twice
    prefix: list[int] = field(default_factory=list)
    # embeddings: POOL_LAST (the final hidden state of the prompt's last row) or POOL_SUM
    # (the sum of its rows'), None for a sequence that samples. A pooled sequence never
    # samples; each row of it pools (POOL_SUM) or the row that ends its prompt does
    # (POOL_LAST), and StepResult.pooled has the vector.
    pooling: str | None = None
    # its LoRA adapter's name (a StepPlan's `adapters` loaded it into a slot, this plan's
    # or an earlier one's); None: the base model
    adapter: str | None = None


@dataclass(slots=True)
class Row:
    """One sequence's part of a step: `num_tokens` consecutive tokens of the plan's
    input_ids (rows are flattened in order) at absolute positions start_pos ..
    start_pos + num_tokens - 1. Their K/V is written into the slots its block tables give,
    and its attention covers positions 0 .. start_pos + num_tokens - 1 (the cached prefix
    and the new tokens, causally). A row that samples takes one token from the logits of
    its last position, with its sequence's SamplingSpec."""

    seq_id: int
    num_tokens: int
    start_pos: int
    # the block ids added to its table in each KV group since its last row (a hybrid
    # model's cache has a table per group of layers, Handshake.kv_group_windows; every
    # group's table is as long), written from entry `blocks_at` on: the table then holds
    # blocks_at + len(blocks[g]) entries. [] adds none. blocks_at is the table's length
    # unless entries were given back (rejected drafts' blocks, BlockManager.trim).
    blocks: list[list[int]] = field(default_factory=list)
    blocks_at: int | None = None  # None: the table's length
    sample: bool = True
    # speculative decoding: the k >= 0 drafted tokens, the last k of the row's tokens (a
    # decoding sequence's chunk is its last sampled token and the drafts). The row samples
    # at its last k + 1 positions and keeps the drafts up to the first it rejects:
    # StepResult.tokens has the j <= k accepted drafts and one token sampled after them
    # (greedy: the argmax, the tokens of decoding without drafts; sampled: rejection
    # sampling, so their distribution too). The cache then holds valid K/V for the
    # chunk's first 1 + j positions; the rest is overwritten by the steps that follow.
    # A draft of DRAFT_MODEL_TOKEN (in drafts and input_ids) is the worker's draft model's
    # to choose, greedily (gpu_worker.draft_model).
    drafts: list[int] = field(default_factory=list)
    # the draft model's cache (WorkerConfig.draft_model_dir) shares the block tables and
    # computes only what a plan asks: the tokens at positions draft_start ..
    # draft_start + len(draft_context) - 1 whose K/V it computes first (the service tracks
    # what it holds). A row with DRAFT_MODEL_TOKEN drafts has context reaching its first
    # position.
    draft_context: list[int] = field(default_factory=list)
    draft_start: int = 0
    # structured output: the tokens its grammar allows at the position it samples, as
    # base64 of little-endian int32 words (bit j of word w allows token 32 * w + j; the
    # words cover the vocabulary, rounded up to 32); None: unconstrained. Disallowed
    # tokens are never sampled; logprobs stay those of the unmasked logits.
    bitmask: str | None = None
    # `echo`: the prompt tokens its positions predict (at most num_tokens), whose
    # log-probabilities StepResult.prompt_logprobs has, each with its sequence's
    # SamplingSpec.prompt_logprobs alternatives; None: none wanted
    prompt_targets: list[int] | None = None


@dataclass(slots=True)
class AdapterLoad:
    """Load the PEFT LoRA adapter at `path` (a directory on the worker's host:
    adapter_config.json and adapter_model.safetensors) into adapter slot `slot` (0 ..
    WorkerConfig.max_loras - 1) under `name`, replacing whatever the slot held. The
    service decides the slots (service.engine.adapters): it never replaces an adapter a
    sequence the worker holds still runs with."""

    slot: int
    name: str
    path: str


@dataclass(slots=True)
class RemoteRank:
    """Where one rank of a producer's tensor-parallel group serves its shard of the cache
    (its Handshake.ranks entry's kv_transfer_address and kv_tensor_addresses)."""

    peer: str  # host:port
    tensors: list[int]
    staging_address: int | None = None  # its arena's region of the pull (KvStage), if staged


@dataclass(slots=True)
class KvPull:
    """Copy a prompt's K/V that another worker (the producer) holds into blocks of this
    worker's cache, then tell the producer `transfer_id` is done (it frees its blocks).
    Both caches have the same layout (the service checked their fingerprints); the
    producer's tensors start at `remote_tensors` and have `remote_num_blocks` blocks."""

    transfer_id: str
    peer: str  # the producer's transfer engine, host:port (Handshake.kv_transfer_address)
    remote_blocks: list[int]
    local_blocks: list[int]  # as many, in the same order
    remote_tensors: list[int]
    remote_num_blocks: int
    # where the producer gathered the blocks (a KvStage's region of its arena), read in one
    # segment then; None: read from its cache, a segment per run, cache tensor and KV head
    remote_staging_address: int | None = None
    # seconds from now within which its read must start: the producer's hold ends soon after
    # (a pull queued behind others past it fails instead of reading freed blocks); None: any
    start_within: float | None = None
    # at tensor parallel size N > 1, each producer rank's, by rank (rank 0's repeats peer
    # and remote_tensors): rank r pulls its shard, its KV heads, from producer rank r
    ranks: list[RemoteRank] = field(default_factory=list)

    def for_rank(self, rank: int) -> KvPull:
        """The part of this pull that rank `rank` of the consumer's group makes; ValueError
        where the pull lists no producer rank for it."""
        if not self.ranks and rank == 0:
            return self
        if rank >= len(self.ranks):
            raise ValueError(
                f"the pull lists {len(self.ranks)} producer ranks: none for rank {rank}"
            )
        mine = self.ranks[rank]
        return dataclasses.replace(
            self,
            peer=mine.peer,
            remote_tensors=mine.tensors,
            remote_staging_address=mine.staging_address,
            ranks=[],
        )

    @classmethod
    def from_message(cls, msg: dict[str, Any]) -> KvPull:
        ranks = [RemoteRank(**rank) for rank in msg.get("ranks", [])]
        return cls(**{**msg, "ranks": ranks})


@dataclass(slots=True)
class KvStage:
    """Gather `blocks`' K/V into the staging arena from block `offset` on, after the step's
    forward pass and before its result (gpu_worker.kv_staging): a producer's prompt that the
    step ends, so its region is written before the answer names it."""

    blocks: list[int]
    offset: int


@dataclass(slots=True)
class PullDone:
    """A KvPull ended: its blocks hold the producer's K/V, or `error` says why not."""

    transfer_id: str
    error: str | None = None
    bytes: int = 0
    segments: int = 0


@dataclass(slots=True)
class StepPlan:
    """One forward pass over a mixed batch (prefill chunks and decode tokens together),
    carrying only what changed: `finished` are dropped first (unknown ids are ignored),
    then `new` are introduced, then each row runs. A row's sequence is one the worker
    holds or one of `new`."""

    step_id: int
    rows: list[Row]
    input_ids: list[int]
    new: list[NewSeq] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)  # sequences the worker forgets
    # transfers the worker starts beside the step (never in its path): their blocks are
    # no row's until StepResult.pulls_done reports them
    pulls: list[KvPull] = field(default_factory=list)
    # LoRA adapters loaded before `new` are introduced and the rows run
    adapters: list[AdapterLoad] = field(default_factory=list)
    # the service awaits news of transfers (pulls in flight, holds outstanding): a
    # tensor-parallel group gathers its ranks' news on such steps only (gpu_worker.kv_ranks)
    transfer_news: bool = False
    # gathers into the staging arena, run once the rows' K/V is written
    stages: list[KvStage] = field(default_factory=list)
    # transfer ids of holds the service ended unreleased (expired): a tensor-parallel group's
    # rank 0 drops what it tallied of them (a consumer gone after some ranks' notices)
    forgotten: list[str] = field(default_factory=list)

    @property
    def seq_ids(self) -> list[int]:
        return [row.seq_id for row in self.rows]

    @property
    def num_tokens(self) -> list[int]:
        return [row.num_tokens for row in self.rows]

    @property
    def start_pos(self) -> list[int]:
        return [row.start_pos for row in self.rows]

    @property
    def sample(self) -> list[bool]:
        return [row.sample for row in self.rows]

    @property
    def sampled_ids(self) -> list[int]:
        """The sequences that sample, in row order: those StepResult.seq_ids answers."""
        return [row.seq_id for row in self.rows if row.sample]

    @property
    def total_tokens(self) -> int:
        return len(self.input_ids)


@dataclass(slots=True)
class StepResult:
    step_id: int
    seq_ids: list[int] = field(default_factory=list)  # the sampled sequences, in plan order
    # per sampled sequence, the tokens it takes this step, in order: one, or with k drafts
    # (Row.drafts) the j <= k it accepted and the token sampled after them
    tokens: list[list[int]] = field(default_factory=list)
    # of the sampled tokens, when any sequence asked for them; a row per token, in the
    # order of `tokens` flattened
    logprobs: TokenLogprobs | None = None
    # one per sequence of the plan when it had prompt_targets (None for those without)
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    step_ms: float = 0.0  # forward + sample, measured in the worker
    error: str | None = None
    # one per sequence of the plan when it had `pooling`: the pooled vector as base64 of
    # little-endian float64 (exact sums of a chunk's rows), None for those without
    pooled: list[str | None] = field(default_factory=list)
    # how long the worker waited for this plan after sending its previous result; None for
    # a first step, after a ping, or after more than MAX_IDLE_GAP_S (the service was idle)
    idle_ms: float | None = None
    # KvPulls that ended since the previous result, and the transfer ids whose K/V a
    # consumer has pulled from this worker (its notices), or has begun to read (its hold is
    # then kept while the read runs)
    pulls_done: list[PullDone] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)
    reading: list[str] = field(default_factory=list)


def to_message(kind: str, record: Any) -> dict[str, Any]:
    # Shallow: orjson serialises nested dataclasses (a plan's SamplingSpecs) itself, far
    # faster than dataclasses.asdict, whose deep copies showed on every step.
    fields = {f.name: getattr(record, f.name) for f in dataclasses.fields(record)}
    return {"type": kind, **fields}


def step_plan_from_message(msg: dict[str, Any]) -> StepPlan:
    new = [NewSeq(**{**n, "sampling": SamplingSpec(**n["sampling"])}) for n in msg.get("new", [])]
    rows = [Row(**row) for row in msg["rows"]]
    pulls = [KvPull.from_message(pull) for pull in msg.get("pulls", [])]
    adapters = [AdapterLoad(**load) for load in msg.get("adapters", [])]
    finished = msg.get("finished", [])
    stages = [KvStage(**stage) for stage in msg.get("stages", [])]
    news, forgotten = msg.get("transfer_news", False), msg.get("forgotten", [])
    return StepPlan(
        msg["step_id"],
        rows,
        msg["input_ids"],
        new,
        finished,
        pulls,
        adapters,
        news,
        stages,
        forgotten,
    )


def record_from_message(cls: type, msg: dict[str, Any]) -> Any:
    """Handshake or WorkerConfig from a decoded message."""
    return cls(**{k: v for k, v in msg.items() if k != "type"})


def step_result_from_message(msg: dict[str, Any]) -> StepResult:
    fields = {k: v for k, v in msg.items() if k != "type"}
    if fields.get("logprobs") is not None:
        fields["logprobs"] = TokenLogprobs(**fields["logprobs"])
    fields["prompt_logprobs"] = [
        None if p is None else TokenLogprobs(**p) for p in fields.get("prompt_logprobs", [])
    ]
    fields["pulls_done"] = [PullDone(**done) for done in fields.get("pulls_done", [])]
    return StepResult(**fields)


def encode_frame(msg: dict[str, Any]) -> bytes:
    # Imported where frames are made, not with the module: the device check
    # (ops/device_check.py) uses the worker's records on hosts that have no orjson.
    import orjson

    body = orjson.dumps(msg)
    return HEADER.pack(len(body)) + body


class FrameDecoder:
    """Incremental decoder: feed bytes as they arrive, take whole messages out."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        import orjson  # see encode_frame

        self._buffer += data
        messages = []
        while len(self._buffer) >= HEADER.size:
            (length,) = HEADER.unpack_from(self._buffer)
            if length > MAX_FRAME_BYTES:
                raise ValueError(f"frame of {length} bytes exceeds the limit")
            end = HEADER.size + length
            if len(self._buffer) < end:
                break
            messages.append(orjson.loads(bytes(self._buffer[HEADER.size : end])))
            del self._buffer[:end]
        return messages
