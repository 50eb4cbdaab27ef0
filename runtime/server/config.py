"""The server's settings: `ServerConfig` (every `optimize serve` flag) and its defaults and limits (port, probe
paths, logprobs, prompts, choices and stop strings per request)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from runtime.kv_events import parse_endpoint
from runtime.speculative import SpeculativeConfig

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_SHUTDOWN_GRACE = 30.0  # seconds in-flight requests get after SIGTERM
HEALTH_PATH = "/health"
READY_PATH = "/ready"
METRICS_PATH = "/metrics"
MAX_LOGPROBS = 20
MAX_PROMPTS = 64  # prompts in one completions request
MAX_N = 16  # choices per prompt
MAX_STOP = 16  # default --max-stop-strings
MAX_STOP_CHARS = 256  # default --max-stop-chars (each stop string)


@dataclass
class ServerConfig:
    artifact: Path
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT  # 0: any free port (the bound one is printed)
    api_key: str | None = None  # when set, /v1/* needs `Authorization: Bearer <key>`
    served_model_name: str | None = None  # default: the artifact's name
    max_waiting: int = 256  # accepted requests not yet running; one more gets 429
    request_timeout: float = 600.0  # seconds from receipt to the last token
    max_body_bytes: int = 1 << 20
    shutdown_grace: float = DEFAULT_SHUTDOWN_GRACE
    # Engine limits (None: the artifact's runtime.json).
    num_kv_blocks: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    threads: int | None = None  # ONNX Runtime intra-op threads
    device: str | None = None  # None: the artifact's target device
    cuda_graphs: str | None = None  # auto | padded | off (GPU backends); None: auto
    warmup: bool = True
    retune: bool = False  # re-measure the C ops' CPU code path at load (runtime/cpu_check.py)
    # Slow and hostile clients.
    header_timeout: float = 10.0  # seconds from connection (or the previous response) to a request's full headers
    body_timeout: float = 30.0  # seconds from the headers to the end of the body
    write_timeout: float = 30.0  # seconds one write to the client may block (a client not reading)
    max_connections: int = 512  # open connections; one more is answered 503 and closed
    max_requests_per_client: int = 0  # unfinished requests per client address (0: no bound)
    max_stop_strings: int = MAX_STOP
    max_stop_chars: int = MAX_STOP_CHARS
    tokenizer_threads: int = 2  # worker threads that tokenize and render chat templates
    # Prefix-cache isolation: requests share cached prompt blocks only with the same salt, made of this
    # header's value (e.g. `Authorization` to salt by API key, or a tenant header set by the gateway)
    # and the request's `cache_salt` field. None: one shared cache (one trust domain).
    cache_salt_header: str | None = None
    cors_origins: tuple[str, ...] = ()  # origins allowed cross-site (CORS); empty: no CORS headers
    # Speculative decoding for requests that do not say (their `speculative` field): None: off, else the
    # default config ("ngram", "ngram:k=4,n=3,min=1", "draft:k=4": runtime/speculative.py).
    speculative: str | None = None
    # The draft model of method "draft" (runtime/draft.py). None: the one the artifact's manifest pairs,
    # loaded when `speculative` is a "draft" config; a folder: that artifact, loaded in any case.
    draft_artifact: Path | None = None
    # KV-cache events (runtime/kv_events.py): tcp://HOST:PORT binds the PUB socket there and the replay
    # socket on PORT + 1. None: off. Token ids travel on it: an internal address only.
    kv_events: str | None = None

    def validate(self) -> None:
        if self.max_waiting < 1:  # every request waits at least until the engine's next step
            raise ValueError(f"max_waiting must be >= 1, got {self.max_waiting}")
        for name in ("max_connections", "max_stop_strings", "max_stop_chars", "tokenizer_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_requests_per_client < 0:
            raise ValueError(f"max_requests_per_client must be >= 0, got {self.max_requests_per_client}")
        for name in ("request_timeout", "shutdown_grace", "header_timeout", "body_timeout", "write_timeout"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive number of seconds, got {value}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.speculative is not None:
            SpeculativeConfig.parse(self.speculative)
        if self.kv_events is not None:
            parse_endpoint(self.kv_events)
