"""Request and response bodies as msgspec Structs.

Requests are decoded in one pass (strict types: a bool where a number belongs, 1.5 for an int, an unknown enum value
-> 400 naming the field). Unknown fields are ignored, as OpenAI clients send many. Messages, tools and template
arguments stay plain JSON values here: the chat layer (dsv41.chat.policy) validates and renders them.
"""
from __future__ import annotations

from typing import Any, Literal, Union

import msgspec

ReasoningEffort = Union[Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"], int]


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(msgspec.Struct, kw_only=True):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None   # token id (as a string) -> bias in [-100, 100]
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    cache_salt: str | None = None          # kept prompt states are shared only within one salt (sched/kept.py)
    prompt_logprobs: int | None = None     # vLLM's; not served: any value but null is a 400
    draft: bool = True                     # false: this request decodes without drafts (docs/drafts.md)


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: ReasoningEffort | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: str | list[Union[int, str, list[int]]]    # a string, ids, or a batch of one of either
    logprobs: int | None = None            # legacy API: the number of top logprobs (0 = only the chosen token's)
    add_special_tokens: bool = True        # a string prompt gets BOS first, as vLLM's completions add it
    skip_special_tokens: bool = True       # the reply's text leaves special tokens out (vLLM's default)
    echo: bool = False
    suffix: str | None = None


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: ReasoningEffort | None = None
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: list[int]
    model: str | None = None


# --- responses (built as Structs so encoding is one pass; omit_defaults keeps optional keys out) ---------------
class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class CompletionTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class DraftUsage(msgspec.Struct):
    """dsv41's usage extension for speculative decoding (docs/drafts.md)."""
    drafted_tokens: int              # draft tokens verified
    accepted_tokens: int             # of them, accepted
    rounds: int                      # rounds that added reply tokens
    tokens_per_round: float          # completion tokens / rounds


class Usage(msgspec.Struct, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails
    drafts: DraftUsage | None = None     # only when the reply verified drafts


class ModelCard(msgspec.Struct):
    id: str
    created: int
    context_length: int
    max_model_len: int
    object: str = "model"
    owned_by: str = "dsv41"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"
