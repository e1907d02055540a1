"""The remote tier's client: a Redis-protocol store that may be slow, down or wrong.

`RemoteStoreClient` is the only code that talks to the store. It owns one
redis-py connection pool (every socket operation bounded by
`remote_timeout_ms`, no driver-level retries) and turns every store problem
into a miss, never an exception for its callers:

    state    UP ----- a connection error / timeout ----> DOWN   (logged, outage += 1)
             ^                                             |
             +-- a call made when the backoff is due -----+   (0.5 s, doubling to 30 s;
                 succeeds (logged, reconnect += 1)             failed probes are silent)
    OFF: the start-up check failed for good (password refused, not a Redis
    server): every call is a miss, no reconnects.

While DOWN, calls return misses at once without touching the network; the
first call after the backoff delay is the reconnect probe (one at a time).
`available` is True when UP or when a probe is due, so the caller's next
write or read is that probe. A store that flaps (a cluster master dead with no
replica) logs at most one outage a minute (`remote_outage_log.py`); every change
is counted. A command the store refuses while up (OOM under
`maxmemory` with noeviction, READONLY on a replica) fails that block only;
its first occurrence of each kind is logged.

Commands (one round trip each, pipelined, never a transaction):
    lookup(keys)        EXISTS per key    -> length of the present prefix
    get_many(keys, n)   TYPE, GETRANGE 0 n per key
                                          -> value (at most n + 1 bytes), None
                                             (absent), or WrongType per key
    put_many(items)     SET k v NX [PX]   -> stored / already present / failed
    delete(key)         UNLINK            (a value that failed its checks, or a key
                                          of another type; freed off the server's
                                          main thread, whatever its size)

Every message names the store by `RemoteUrl.shown` (password masked) and
passes foreign text (a driver's exception) through `RemoteUrl.scrub`.
Thread-safe: the copy engine's lanes and the control thread share one client.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import redis
from redis.exceptions import AuthenticationError, InvalidResponse, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvswap.base.remote_index import RemoteIndex
from kvswap.data.redis_clients import (
    CLUSTER_OUTAGE_ERRORS,
    LazyCluster,
    server_client,
)
from kvswap.data.remote_format import check_namespace, key_name
from kvswap.data.remote_outage_log import OutageLog
from kvswap.data.remote_url import PASSWORD_ENV, RemoteUrl
from kvswap.errors import KvSwapError
from kvswap.units import MIB

if TYPE_CHECKING:
    from typing_extensions import Buffer

LOGGER = logging.getLogger("kvswap.remote")
#: Keys one lookup asks about; a longer prefix answers at most this many (a
#: shorter hit is always safe) and the caller may ask again from there.
MAX_LOOKUP_KEYS = 1024
#: Bytes per socket read (redis-py's default: 64 KiB): a 1 MiB value arrives in a
#: few reads instead of sixteen; the price is a 1 MiB buffer per connection.
DEFAULT_SOCKET_READ_BYTES = MIB
FIRST_RETRY_S = 0.5
MAX_RETRY_S = 30.0

# The store is unreachable, timed out or not speaking the protocol: an outage.
_OUTAGE_ERRORS = (
    RedisConnectionError, RedisTimeoutError, InvalidResponse, OSError,
    *CLUSTER_OUTAGE_ERRORS,
)  # fmt: skip
T = TypeVar("T")
#: What a command runs on: one server's client, or a cluster's.
Connection = redis.Redis | redis.RedisCluster


class _State(enum.Enum):
    UP = "up"
    DOWN = "down"
    OFF = "off"


class _Go(enum.Enum):
    """What a call may do: run, run as the reconnect probe, or answer a miss now."""

    RUN = enum.auto()
    PROBE = enum.auto()
    SKIP = enum.auto()


@dataclass(frozen=True)
class WrongType:
    """A key that holds no string (a list, a hash, a set...): no block's value."""

    type_name: str


@dataclass(frozen=True)
class PutOutcome:
    """What became of the items of one `put_many`, by index into its items."""

    num_stored: int
    num_already_present: int
    failed_indices: tuple[int, ...]
    error: str | None = None


class Backoff:
    """Reconnect delays: `first_s`, doubling after each failed probe, at most `max_s`."""

    def __init__(self, first_s: float = FIRST_RETRY_S, max_s: float = MAX_RETRY_S) -> None:
        if not 0 < first_s <= max_s:
            raise ValueError(f"backoff needs 0 < first_s <= max_s, got {first_s}, {max_s}")
        self.first_s = first_s
        self.max_s = max_s
        self.delay_s = first_s

    def reset(self) -> None:
        self.delay_s = self.first_s

    def grow(self) -> None:
        self.delay_s = min(self.delay_s * 2, self.max_s)


class RemoteStoreClient(RemoteIndex):
    """One store, one connection pool, the outage state machine above."""

    def __init__(
        self,
        url: RemoteUrl,
        *,
        namespace: str,
        timeout_ms: float,
        clock: Callable[[], float] = time.monotonic,
        backoff: Backoff | None = None,
        socket_read_bytes: int = DEFAULT_SOCKET_READ_BYTES,
    ) -> None:
        """`clock`: seconds, for the backoff only (tests inject one)."""
        if not timeout_ms > 0:
            raise ValueError(f"timeout_ms must be > 0, got {timeout_ms}")
        self.url = url
        self.namespace = check_namespace(namespace, cluster=url.is_cluster)
        self.timeout_s = timeout_ms / 1000.0
        self._clock = clock
        self._backoff = backoff or Backoff()
        self._lock = threading.Lock()
        self._state = _State.UP
        self._probing = False
        self._next_probe_s = 0.0
        self._down_since_s = 0.0
        self._num_outages = 0
        self._num_reconnects = 0
        self._outage_log = OutageLog()
        self._logged_refusals: set[str] = set()
        self.server_version: str | None = None
        # One server: its client now (it connects on first use). A cluster: built by
        # the first call that reaches a seed node (redis_clients.py).
        self._redis: redis.Redis | None = None
        self._cluster: LazyCluster | None = None
        if url.is_cluster:
            self._cluster = LazyCluster(url, self.timeout_s, socket_read_bytes)
        else:
            self._redis = server_client(url, self.timeout_s, socket_read_bytes)

    # --- state ------------------------------------------------------------------

    @property
    def available(self) -> bool:
        """Up, or down with a reconnect probe due (the next call tries)."""
        with self._lock:
            if self._state is _State.UP:
                return True
            due = self._clock() >= self._next_probe_s and not self._probing
            return self._state is _State.DOWN and due

    @property
    def num_outages(self) -> int:
        """Times the store went from up to down (a failed start counts once)."""
        return self._num_outages

    @property
    def num_reconnects(self) -> int:
        """Times the store came back after an outage (a flapping store: about
        `num_outages`, logged or not)."""
        return self._num_reconnects

    def connect(self, *, required: bool) -> bool:
        """Check the store at start: PING, and INFO server names a Redis or Valkey
        version. True: up. Otherwise one line: a `KvSwapError` if `required`, else a
        logged warning and the tier is off (until a reconnect succeeds, when the
        store was unreachable; for good when it refused us or is not Redis)."""
        problem, retryable = self._check_server()
        if problem is None:
            with self._lock:
                self._state = _State.UP
            return True
        if required:
            raise KvSwapError(f"{problem}; tiers.remote_required is true")
        with self._lock:
            if retryable:
                self._enter_down_locked()  # logged below: the first outage always is
            else:
                self._state = _State.OFF
        until = f", retrying in {self._backoff.delay_s:g} s" if retryable else ""
        LOGGER.warning("%s; the remote tier is off%s", problem, until)
        return False

    def close(self) -> None:
        """Close every pooled connection; the client answers misses afterwards."""
        with self._lock:
            self._state = _State.OFF
        if self._redis is not None:
            self._redis.close()
            self._redis.connection_pool.disconnect()
        if self._cluster is not None:
            self._cluster.close()

    # --- commands ---------------------------------------------------------------

    def key_name(self, key: bytes) -> bytes:
        return key_name(self.namespace, key)

    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many of `keys`, from the first, the store holds; at most MAX_LOOKUP_KEYS."""
        names = [self.key_name(key) for key in keys[:MAX_LOOKUP_KEYS]]
        if not names:
            return 0

        def op(client: Connection) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for name in names:
                pipe.exists(name)
            return pipe.execute()

        answers: list[Any] = self._call("lookup", op, [])
        count = 0
        for present in answers:
            if present != 1:
                break
            count += 1
        return count

    def get_many(
        self, keys: Sequence[bytes], max_value_bytes: int
    ) -> list[bytes | WrongType | None]:
        """Each key's stored value; None (absent, the store down, a refused read); or
        `WrongType` for a key that holds no string.

        At most `max_value_bytes + 1` bytes of a value are read (GETRANGE): a longer
        one arrives cut there, one byte too long for the caller's size check, and is
        never moved whole (a 200 MB value under a block key would run into the
        timeout and count as an outage on every read). TYPE, asked before it in the
        same pipeline (one round trip, each key's two commands on its own node in a
        cluster), tells an absent key from an empty value (GETRANGE answers both
        with b"") and a key of another type from a refused read."""
        if max_value_bytes < 0:
            raise ValueError(f"max_value_bytes must be >= 0, got {max_value_bytes}")

        def op(client: Connection) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for key in keys:
                name = self.key_name(key)
                pipe.type(name)
                pipe.getrange(name, 0, max_value_bytes)  # both ends included
            return pipe.execute(raise_on_error=False)

        answers = self._call("get", op, None)
        if answers is None:
            return [None] * len(keys)
        kinds, values = answers[0::2], answers[1::2]
        found = [_found(kind, value) for kind, value in zip(kinds, values, strict=True)]
        # GETRANGE on a key of another type is refused (WRONGTYPE): expected, not noted.
        self._note_refusals("get", [
            answer
            for kind, value, result in zip(kinds, values, found, strict=True)
            for answer in (kind, value if not isinstance(result, WrongType) else None)
        ])  # fmt: skip
        return found

    def put_many(self, items: Sequence[tuple[bytes, Buffer]], ttl_s: float = 0.0) -> PutOutcome:
        """SET each (key, value) unless present (NX: a stored block is never
        rewritten), expiring after `ttl_s` when > 0."""
        expire_ms = max(1, round(ttl_s * 1000)) if ttl_s > 0 else None

        def op(client: Connection) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            for key, value in items:
                pipe.set(self.key_name(key), value, nx=True, px=expire_ms)  # type: ignore[arg-type]
            return pipe.execute(raise_on_error=False)

        answers = self._call("put", op, None)
        if answers is None:
            return PutOutcome(0, 0, tuple(range(len(items))), "the remote store is unavailable")
        self._note_refusals("put", answers)
        failed = tuple(index for index, answer in enumerate(answers) if answer not in (True, None))
        refusal = next((answer for answer in answers if isinstance(answer, Exception)), None)
        return PutOutcome(
            num_stored=sum(1 for answer in answers if answer is True),
            num_already_present=sum(1 for answer in answers if answer is None),
            failed_indices=failed,
            error=None if refusal is None else self._text(refusal),
        )

    def delete(self, key: bytes) -> None:
        """Remove a key (a value that failed its checks, or a key of another type);
        nothing if the store is down. UNLINK, not DEL: a key of any type or size is
        freed off the server's main thread."""
        self._call("delete", lambda client: client.unlink(self.key_name(key)), 0)

    # --- the state machine --------------------------------------------------------

    def _call(self, what: str, op: Callable[[Connection], T], miss: T) -> T:
        go = self._begin()
        if go is _Go.SKIP:
            return miss
        try:
            result = op(self._connection())
        except _OUTAGE_ERRORS as exc:
            self._failed(exc, go)
            return miss
        except ResponseError as exc:  # up, but this command was refused
            self._succeeded(go)
            self._note_refusals(what, [exc])
            return miss
        except BaseException:
            if go is _Go.PROBE:  # a bug, not the store: let a later call probe again
                with self._lock:
                    self._probing = False
            raise
        self._succeeded(go)
        return result

    def _begin(self) -> _Go:
        with self._lock:
            if self._state is _State.UP:
                return _Go.RUN
            if self._state is _State.OFF or self._probing:
                return _Go.SKIP
            if self._clock() < self._next_probe_s:
                return _Go.SKIP
            self._probing = True
            return _Go.PROBE

    def _failed(self, exc: BaseException, go: _Go) -> None:
        with self._lock:
            now_s = self._clock()
            if self._state is _State.UP:
                num_left_out = self._enter_down_locked()
                went_down = True
            else:
                went_down, num_left_out = False, None
                if go is _Go.PROBE:
                    self._backoff.grow()
                    self._next_probe_s = now_s + self._backoff.delay_s
                    self._probing = False
                    num_left_out = self._outage_log.down(now_s, began=False)
            delay_s = self._backoff.delay_s
            down_s = now_s - self._down_since_s
        if num_left_out is None:
            return
        lasting = "" if went_down else f" for {down_s:.1f} s"
        left_out = ""
        if num_left_out:
            left_out = (
                f" ({num_left_out} outages since the last such line were not logged: "
                f"one line per {self._outage_log.interval_s:g} s)"
            )
        LOGGER.warning(
            "remote store at %s is unreachable%s (%s); the remote tier is off, "
            "retrying in %g s%s",
            self.url.shown, lasting, self._text(exc), delay_s, left_out,
        )  # fmt: skip

    def _succeeded(self, go: _Go) -> None:
        if go is not _Go.PROBE:
            return
        with self._lock:
            self._probing = False
            if self._state is not _State.DOWN:  # closed meanwhile
                return
            self._state = _State.UP
            self._num_reconnects += 1
            self._backoff.reset()
            down_s = self._clock() - self._down_since_s
            logged = self._outage_log.up()
        if logged:
            LOGGER.warning(
                "remote store at %s is reachable again after %.1f s", self.url.shown, down_s
            )

    def _enter_down_locked(self) -> int | None:
        """UP -> DOWN; what `OutageLog.down` says about logging it."""
        now_s = self._clock()
        self._state = _State.DOWN
        self._num_outages += 1
        self._down_since_s = now_s
        self._backoff.reset()
        self._next_probe_s = now_s + self._backoff.delay_s
        return self._outage_log.down(now_s, began=True)

    def _note_refusals(self, what: str, answers: Sequence[object]) -> None:
        for answer in answers:
            if isinstance(answer, ResponseError):
                kind = f"{what}:{type(answer).__name__}"
                with self._lock:
                    first = kind not in self._logged_refusals
                    self._logged_refusals.add(kind)
                if first:
                    LOGGER.warning(
                        "remote store at %s refused a %s (%s); those blocks are misses",
                        self.url.shown, what, self._text(answer),
                    )  # fmt: skip

    def _check_server(self) -> tuple[str | None, bool]:
        """(problem, retryable): None when the store is a Redis / Valkey server."""
        where = f"remote store at {self.url.shown}"
        try:
            connection = self._connection()
            connection.ping()
            info = connection.info("server")
        except AuthenticationError:
            if self.url.password is None:
                return f"{where} needs a password (in the URL or {PASSWORD_ENV})", False
            source = f" (from {PASSWORD_ENV})" if self.url.password_from_env else ""
            return f"{where} refused the password{source}", False
        except InvalidResponse:
            return f"{where} did not answer in the Redis protocol (not a Redis server?)", False
        except _OUTAGE_ERRORS as exc:
            return f"{where} is unreachable ({self._text(exc)})", True
        except ResponseError as exc:
            if "DB index" in str(exc):
                return f"{where} has no db {self.url.db} ({self._text(exc)})", False
            return f"{where} refused the connection ({self._text(exc)})", False
        for field in ("valkey_version", "redis_version"):
            if field in info:
                self.server_version = f"{field.partition('_')[0]} {info[field]}"
                return None, False
        return f"{where} speaks the protocol but is not a Redis or Valkey server", False

    def _connection(self) -> Connection:
        """The client commands run on (a cluster's is built here, raising an outage
        error while no seed node answers)."""
        if self._cluster is not None:
            return self._cluster.get()
        assert self._redis is not None  # one or the other, from __init__
        return self._redis

    def _text(self, exc: BaseException) -> str:
        """An exception as one line, this URL's password masked."""
        text = " ".join(str(exc).split()) or type(exc).__name__
        return self.url.scrub(f"{type(exc).__name__}: {text}")


def _found(kind: object, value: object) -> bytes | WrongType | None:
    """One key's answer from its TYPE and GETRANGE replies (either may be a refusal)."""
    if isinstance(value, bytes) and (value or kind == b"string"):
        return value  # a string, an empty one too (it fails the caller's size check)
    if isinstance(kind, bytes) and kind not in (b"none", b"string"):
        return WrongType(kind.decode("ascii", "replace"))
    return None  # absent, or a refused read
