"""`POST /v1/completions`: one or more prompts (text or token ids), n choices each, answered or streamed."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from hearth.server.disconnect import respond
from hearth.server.errors import APIError, bad_request
from hearth.server.generation import (
    CompletionLogprobs,
    Generation,
    check_logit_bias,
    engine_error,
    engine_failure,
    logger,
    new_request_id,
    prompt_logprobs_entries,
    resolve_max_tokens,
    sampling_params,
    structured_output,
)
from hearth.server.pd import engine_kv_transfer
from hearth.server.protocol import CompletionRequest
from hearth.server.sse import DONE_EVENT, sse_event
from hearth.server.state import ServerState

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy completions endpoint


async def _prompt_token_lists(state: ServerState, request: CompletionRequest) -> list[list[int]]:
    """The prompts as token lists; what can never be served (more sequences than the server admits, a
    text longer than any context) is refused before anything is tokenized."""
    prompts = state.require_prompts()
    prompt = request.prompt
    texts: list[str] | None = None
    if isinstance(prompt, str):
        texts = [prompt]
    elif all(isinstance(item, str) for item in prompt):
        texts = list(prompt)  # type: ignore[arg-type]
    if texts is not None:
        num_prompts = len(texts)
    else:
        num_prompts = 1 if all(isinstance(item, int) for item in prompt) else len(prompt)
    state.admission.check_can_ever_admit(num_prompts * request.n, "prompt")
    if texts is not None:
        for text in texts:
            prompts.check_fits(len(text), "prompt")
        num_chars = sum(len(text) for text in texts)
        token_lists = await prompts.run(
            num_chars, lambda: [prompts.encode_now(text, add_special_tokens=True) for text in texts]
        )
    elif all(isinstance(item, int) for item in prompt):
        token_lists = [list(prompt)]  # type: ignore[arg-type]
    else:
        token_lists = [list(item) for item in prompt]  # type: ignore[union-attr]
    vocab_size = prompts.tokenizer.vocab_size
    for tokens in token_lists:
        if not tokens:
            raise bad_request("the prompt is empty", "prompt")
        if max(tokens) >= vocab_size:
            raise bad_request(f"prompt token ids must be below the vocabulary size {vocab_size}", "prompt")
    return token_lists


async def create_completion(state: ServerState, request: CompletionRequest, raw: Request) -> Response:
    state.check_model(request.model)
    engine = state.require_engine()
    if request.suffix:
        raise bad_request("suffix (fill-in-the-middle) is not supported", "suffix")
    check_logit_bias(request, engine.vocab_size)
    prompts = await _prompt_token_lists(state, request)
    # `echo` + `logprobs`: the prompt's tokens are scored too (how lm-evaluation-harness reads log-likelihoods).
    scored = request.echo and request.logprobs is not None
    prompt_top = None
    if scored or request.prompt_logprobs is not None:
        prompt_top = max(request.logprobs or 0 if scored else 0, request.prompt_logprobs or 0)
    n = request.n
    token_lists: list[list[int]] = []
    params = []
    prompt_index = []
    structured = structured_output(request)
    for p, tokens in enumerate(prompts):
        max_tokens = resolve_max_tokens(
            request.max_tokens, len(tokens), engine.max_model_len, DEFAULT_MAX_TOKENS, "prompt"
        )
        for i in range(n):
            token_lists.append(tokens)
            params.append(
                sampling_params(
                    request,
                    max_tokens,
                    request.logprobs,
                    choice_index=i,
                    structured=structured,
                    prompt_logprobs=prompt_top,
                )
            )
            prompt_index.append(p)
    request_id = new_request_id("cmpl")
    affinity = raw.headers.get("x-session-affinity")
    if affinity:
        logger.info("request %s session-affinity=%s", request_id, affinity)
    generation = Generation(
        state,
        request_id,
        token_lists,
        params,
        request.cache_salt,
        prompt_index,
        kv_transfer=await engine_kv_transfer(state, request, len(token_lists)),
    )
    generation.admit()
    echoes = [engine.tokenizer.decode(tokens) if request.echo else "" for tokens in token_lists]
    return await respond(
        raw,
        request.stream,
        lambda: _stream(state, request, generation, echoes, token_lists),
        lambda: _complete(state, request, generation, echoes, token_lists),
        generation.close,
    )


async def _complete(
    state: ServerState,
    request: CompletionRequest,
    generation: Generation,
    echoes: list[str],
    prompts: list[list[int]],
) -> Response:
    num_choices = len(echoes)
    texts = list(echoes)
    logprobs = [CompletionLogprobs() for _ in range(num_choices)]
    offsets = [len(echo) for echo in echoes]
    prompt_entries: list[list[dict[str, Any] | None] | None] = [None] * num_choices
    finish: list[tuple[str | None, str | int | None]] = [(None, None)] * num_choices
    try:
        async for index, output in generation.outputs():
            failure = engine_failure(output)
            if failure is not None:
                raise failure
            if output.prompt_logprobs is not None:
                if request.echo and request.logprobs is not None:
                    offsets[index] = logprobs[index].add_prompt(
                        state, prompts[index], output.prompt_logprobs, request.logprobs
                    )
                if request.prompt_logprobs is not None:
                    prompt_entries[index] = prompt_logprobs_entries(
                        state, prompts[index], output.prompt_logprobs
                    )
            texts[index] += output.new_text
            if request.logprobs is not None and output.new_logprobs:
                offsets[index] = logprobs[index].add(
                    state, output.new_logprobs, request.logprobs, offsets[index]
                )
            if output.finished:
                finish[index] = (output.finish_reason, output.stop_reason)
    except APIError:
        raise
    except Exception as exc:
        raise engine_error(exc) from exc
    choices = [
        {
            "index": index,
            "text": texts[index],
            "logprobs": logprobs[index].as_dict() if request.logprobs is not None else None,
            "finish_reason": finish[index][0],
            "stop_reason": finish[index][1],
        }
        for index in range(num_choices)
    ]
    if request.prompt_logprobs is not None:
        for choice, entries in zip(choices, prompt_entries, strict=True):
            choice["prompt_logprobs"] = entries
    body = {
        "id": generation.request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": state.config.model_name,
        "choices": choices,
        "usage": generation.usage(),
    }
    kv_transfer = generation.kv_transfer_answer()
    if kv_transfer is not None:
        body["kv_transfer"] = kv_transfer
    return JSONResponse(body)


async def _stream(
    state: ServerState,
    request: CompletionRequest,
    generation: Generation,
    echoes: list[str],
    prompts: list[list[int]],
) -> AsyncIterator[bytes]:
    include_usage, continuous_usage = request.usage_in_stream
    base = {
        "id": generation.request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": state.config.model_name,
    }
    offsets = [len(echo) for echo in echoes]

    def chunk(
        index: int,
        text: str,
        logprobs: Any = None,
        finish_reason: str | None = None,
        stop_reason: str | int | None = None,
        prompt_logprobs: list[dict[str, Any] | None] | None = None,
    ) -> bytes:
        choice = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
        }
        if prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs
        payload: dict[str, Any] = {**base, "choices": [choice]}
        if include_usage:
            payload["usage"] = generation.usage() if continuous_usage else None
        return sse_event(payload)

    # With logprobs (or prompt_logprobs) the echo waits for the prompt's logprobs, which come with the first output.
    echo_waits = request.logprobs is not None or request.prompt_logprobs is not None
    try:
        for index, echo in enumerate(echoes):
            if echo and not echo_waits:
                yield chunk(index, echo)
        async for index, output in generation.outputs():
            failure = engine_failure(output)
            if failure is not None:
                yield sse_event(failure.body())
                break
            if output.prompt_logprobs is not None:
                echo_logprobs = None
                if request.echo and request.logprobs is not None:
                    built = CompletionLogprobs()
                    offsets[index] = built.add_prompt(
                        state, prompts[index], output.prompt_logprobs, request.logprobs
                    )
                    echo_logprobs = built.as_dict()
                entries = None
                if request.prompt_logprobs is not None:
                    entries = prompt_logprobs_entries(state, prompts[index], output.prompt_logprobs)
                yield chunk(index, echoes[index], echo_logprobs, prompt_logprobs=entries)
            logprobs = None
            if request.logprobs is not None and output.new_logprobs:
                built = CompletionLogprobs()
                offsets[index] = built.add(state, output.new_logprobs, request.logprobs, offsets[index])
                logprobs = built.as_dict()
            if output.finished:
                yield chunk(index, output.new_text, logprobs, output.finish_reason, output.stop_reason)
            elif output.new_text or logprobs is not None:
                yield chunk(index, output.new_text, logprobs)
        else:
            if include_usage:
                yield sse_event({**base, "choices": [], "usage": generation.usage()})
    except APIError as exc:
        yield sse_event(exc.body())
    except Exception as exc:
        yield sse_event(engine_error(exc).body())
    finally:
        generation.close()
    yield DONE_EVENT
