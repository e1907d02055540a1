"""Text for workloads that only have lengths and block hashes.

A remote server tokenizes text itself, so the workload's token ids (see
`kvswap.workload.tokens`) are rendered as words: id i is `WORDS[i]`, words
joined by single spaces. The workload is built with `vocab_size = VOCAB_SIZE`,
so every id names a word. What carries over from the ids:

- equal hash ids give equal word blocks, hence equal text prefixes, on any
  server: two trace rows sharing their first k hash ids share the text of
  their first k blocks, and a server's prefix cache can see exactly the
  sharing the trace describes (and no sharing it does not);
- the same trace or seed gives the same text on every run and machine.

Lengths follow the server's tokenizer through a `TextScale` (measured by
`calibrate.py` before the replay): a part of n intended tokens is sent as about
n x `words_per_token` words, less the words of the template tokens the server
adds around it. Word j of a part is the word of id floor(j / words_per_token),
one uniform rate for every part, so equal id prefixes still give equal word
prefixes (the hash-id property above) at any rate, and a shorter part is a
prefix of a longer one. Output lengths (`max_tokens`) are never scaled. The
default scale (1 word per token, no overhead) is `--no-calibrate`'s: the words
are short, common lowercase English words that BPE tokenizers of the Llama,
Qwen, Mistral and GPT families encode as about one token each; a byte-level
tokenizer takes about five. The server's `usage.prompt_tokens` is the real
count, and it is what the summary reports beside the intended length.

Conversations (`PromptBook`):

    turn 0   [system: sys words] [user: user0 words]                 (chat)
    turn 1   turn-0 messages + [assistant: reply0 as returned] + [user: user1]
    completions: turn k's prompt = turn k-1's prompt + reply + " " + user k words
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from kvswap.workload.request import Workload

Endpoint = Literal["chat", "completions"]
ENDPOINTS: tuple[Endpoint, ...] = ("chat", "completions")

# 256 short common words (a power of two, so the id -> word map is uniform).
WORDS: tuple[str, ...] = tuple(
    """
    the of and to in is it you that he was for on are as with his they at be this
    have from or one had by word but not what all were we when your can said there
    use an each which she do how their if will up other about out many then them
    these so some her would make like him into time has look two more write go see
    number no way could people my than first water been call who oil its now find
    long down day did get come made may part over new sound take only little work
    know place year live me back give most very after thing our just name good
    man think say great where help through much before line right too mean old any
    same tell boy follow came want show also around form three small set put end
    does another well large must big even such because turn here why ask went men
    read need land different home us move try kind hand picture again change off
    play spell air away animal house point page letter mother answer found study
    still learn should world high every near add food between own below country
    plant last school father keep tree never start city earth eye light thought
    head under story saw left few while along might close something seem next hard
    open example begin life always those both paper together got group often run
    music color black white green blue red fish bird river song
    """.split()  # noqa: SIM905 (a block of words reads better than 256 quoted strings)
)
VOCAB_SIZE = len(WORDS)
assert VOCAB_SIZE == 256 and len(set(WORDS)) == VOCAB_SIZE, "the word list has 256 words"


def words_text(ids: Sequence[int]) -> str:
    """The ids as words, separated by single spaces (ids must be < VOCAB_SIZE)."""
    return " ".join([WORDS[i] for i in ids])


@dataclass(frozen=True)
class TextScale:
    """How intended token counts become words for the server's tokenizer.

    One word costs `1 / words_per_token` tokens; the chat template (or a BOS token)
    adds `request_overhead_tokens` once per request (one message included) and
    `message_overhead_tokens` per further message. The default is 1 word per token
    with no overhead: lengths uncalibrated.
    """

    words_per_token: float = 1.0
    request_overhead_tokens: float = 0.0
    message_overhead_tokens: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.words_per_token) and self.words_per_token > 0):
            raise ValueError(f"words_per_token = {self.words_per_token}: allowed: > 0")
        for name in ("request_overhead_tokens", "message_overhead_tokens"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} = {value}: allowed: a finite number >= 0")

    def text(self, ids: Sequence[int], overhead_tokens: float = 0.0) -> str:
        """`ids` (an intended part of len(ids) tokens, `overhead_tokens` of which the
        server adds itself) as words: word j is the word of id floor(j / rate), so the
        text of a prefix of `ids` is a prefix of this text, whatever the rate."""
        if not ids:
            return ""
        rate = self.words_per_token
        num_words = max(1, round((len(ids) - overhead_tokens) * rate))
        last = len(ids) - 1
        return " ".join([WORDS[ids[min(last, int(j / rate))]] for j in range(num_words)])


Message = dict[str, str]


@dataclass(frozen=True)
class PromptInput:
    """A request's input fields and the prompt length the workload intends for it."""

    fields: dict[str, object]  # {"messages": [...]} or {"prompt": "..."}
    intended_prompt_tokens: int


@dataclass
class _Turn:
    """A sent turn that a follow-up will extend."""

    input: list[Message] | str
    intended_prompt_tokens: int
    reply: str | None = None
    output_tokens: int = 0


class PromptBook:
    """The input of every request of `workload`, built when the request is sent.

    `input_for(request_id)` gives {"messages": [...]} (chat) or {"prompt": "..."}
    (completions) and the intended prompt length. A later turn needs its previous
    turn's input and reply: the replay calls `record_reply` once that turn
    completed. A turn's input is kept only while a follow-up still needs it, so
    memory stays bounded by the conversations in flight.

    The intended length is the workload's, as `kvswap run` would prefill it: a
    first turn's prompt ids; a later turn's is the previous turn's intended length
    + the previous reply's output tokens (the server's count) + its new user ids.

    `system_prompt_tokens` is the synthetic workload's system prompt length: the
    first that many ids of a first turn are sent as the system message (chat) so
    that every session starts with the same system text. 0: no system message.
    Every part is rendered with `scale`; a part's template overhead is taken off
    its own words (the user message of a first turn carries the request's, a
    system message and each later turn's assistant and user messages their own),
    so a whole prompt is about its intended length on the server.
    """

    def __init__(
        self,
        workload: Workload,
        endpoint: Endpoint,
        system_prompt_tokens: int = 0,
        scale: TextScale = TextScale(),
    ):
        self.workload = workload
        self.endpoint = endpoint
        self.system_prompt_tokens = system_prompt_tokens
        self.scale = scale
        self._turns: dict[int, _Turn] = {}

    def input_for(self, request_id: int) -> PromptInput:
        request = self.workload[request_id]
        follow_up = request.follow_up
        current: list[Message] | str
        if follow_up is None:
            current = self._first_turn(request.prompt_ids)
            intended = len(request.prompt_ids)
        else:
            previous = self._turns.pop(follow_up.previous_request_id)
            assert previous.reply is not None, "a follow-up is sent after its turn completed"
            new_ids = follow_up.new_user_ids
            intended = previous.intended_prompt_tokens + previous.output_tokens + len(new_ids)
            if isinstance(previous.input, str):
                current = f"{previous.input}{previous.reply} {self.scale.text(new_ids)}"
            else:
                # Two more messages: the reply and the new user turn, each wrapped.
                overhead = 2 * self.scale.message_overhead_tokens
                current = [
                    *previous.input,
                    {"role": "assistant", "content": previous.reply},
                    {"role": "user", "content": self.scale.text(new_ids, overhead)},
                ]
        if self.workload.follow_ups_of(request_id):
            self._turns[request_id] = _Turn(current, intended)
        fields: dict[str, object] = (
            {"prompt": current} if isinstance(current, str) else {"messages": current}
        )
        return PromptInput(fields, intended)

    def record_reply(self, request_id: int, reply_text: str, output_tokens: int) -> None:
        """The assistant's reply to `request_id`, exactly as the server returned it,
        and its output tokens."""
        turn = self._turns.get(request_id)
        if turn is not None:
            turn.reply, turn.output_tokens = reply_text, output_tokens

    def forget(self, request_id: int) -> None:
        """`request_id` failed or was cancelled: its follow-ups will not be sent."""
        self._turns.pop(request_id, None)

    def _first_turn(self, prompt_ids: Sequence[int]) -> list[Message] | str:
        scale = self.scale
        if self.endpoint == "completions":
            return scale.text(prompt_ids, scale.request_overhead_tokens)
        num_system = min(self.system_prompt_tokens, len(prompt_ids))
        messages: list[Message] = []
        if num_system:
            system = scale.text(prompt_ids[:num_system], scale.message_overhead_tokens)
            messages.append({"role": "system", "content": system})
        user = scale.text(prompt_ids[num_system:], scale.request_overhead_tokens)
        messages.append({"role": "user", "content": user})
        return messages
