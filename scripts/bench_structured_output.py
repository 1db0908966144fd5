"""Structured output cost, in one process: each constrained batch is paired with an unconstrained batch of the
same shape (same prompts, each request forced to the same number of tokens with ignore_eos), so the CPU-time
ratio is what the grammar costs. Rounds alternate the order of the pair.

    python scripts/bench_structured_output.py models/demo
"""

import json
import sys
import time

import jsonschema

from hearth.engine import structured_output as so
from hearth.engine import worker as worker_module
from hearth.engine.llm import LLM
from hearth.engine.sampling_params import SamplingParams
from hearth.engine.structured_output import StructuredOutput

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "arguments": {
            "type": "object",
            "properties": {
                "path": {"type": "string", "maxLength": 40},
                "limit": {"type": "integer", "minimum": 1, "maximum": 500},
            },
            "required": ["path", "limit"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
llm = LLM(sys.argv[1], num_threads=1)
engine = llm.engine
mask_s = [0.0]


def timed(real):
    def wrapper(*args):
        started = time.process_time()
        result = real(*args)
        mask_s[0] += time.process_time() - started
        return result

    return wrapper


# The mask's two halves: computed by the engine (before the step), applied to the logits by the worker.
engine.structured.compute_bitmask = timed(engine.structured.compute_bitmask)
worker_module.apply_bitmask = timed(worker_module.apply_bitmask)
accept_s = [0.0]
real_accept = so.GrammarMatcher.accept


def timed_accept(self, token_id):
    started = time.process_time()
    ok = real_accept(self, token_id)
    accept_s[0] += time.process_time() - started
    return ok


so.GrammarMatcher.accept = timed_accept
prompts = [
    f"<|im_start|>user\nRead file number {i} and reply with a JSON tool call.<|im_end|>\n<|im_start|>assistant\n"
    for i in range(16)
]
t = time.perf_counter()
engine.structured.new_matcher(StructuredOutput.json_schema(SCHEMA))
print(
    f"vocab {engine.tokenizer.vocab_size}; first constrained request (llguidance tokenizer + grammar): {1e3 * (time.perf_counter() - t):.1f} ms; "
    f"same schema again (cached grammar): ",
    end="",
)
t = time.perf_counter()
engine.structured.new_matcher(StructuredOutput.json_schema(SCHEMA))
print(f"{1e3 * (time.perf_counter() - t):.2f} ms")


def run(params):
    mask_s[0] = 0.0
    accept_s[0] = 0.0
    started = time.process_time()
    results = llm.generate(prompts, params)
    return results, time.process_time() - started, mask_s[0] + accept_s[0]


print(
    "| answers | tokens | CPU s constrained | CPU s same shape, unconstrained | ratio | grammar share (mask + advance) | grammar us / token | finished: valid JSON |"
)
print("|---|---|---|---|---|---|---|---|")
for name, spec in {
    "json_object": StructuredOutput.json_object(),
    "json_schema": StructuredOutput.json_schema(SCHEMA),
}.items():
    tot = [0, 0.0, 0.0, 0.0, 0, 0, 0]
    for round_ in range(3):
        constrained = [
            SamplingParams(max_tokens=96, temperature=0.8, seed=100 * round_ + i, structured_output=spec)
            for i in range(16)
        ]
        lengths = [len(r.token_ids) for r in run(constrained)[0]]  # seeded: the timed run repeats it exactly
        free = [
            SamplingParams(max_tokens=n, temperature=0.8, seed=100 * round_ + i, ignore_eos=True)
            for i, n in enumerate(lengths)
        ]
        if round_ % 2:
            results, c_cpu, c_mask = run(constrained)
            f_cpu = run(free)[1]
        else:
            f_cpu = run(free)[1]
            results, c_cpu, c_mask = run(constrained)
        assert [len(r.token_ids) for r in results] == lengths
        for r in results:
            if r.finish_reason == "stop":
                value = json.loads(r.text)
                if spec.kind == "json_schema":
                    jsonschema.validate(value, SCHEMA)
                else:
                    assert isinstance(value, dict)
                tot[5] += 1
        tot[0] += sum(lengths)
        tot[1] += c_cpu
        tot[2] += f_cpu
        tot[3] += c_mask
        tot[6] += len(results)
    print(
        f"| {name} | {tot[0]} | {tot[1]:.2f} | {tot[2]:.2f} | {tot[1] / tot[2]:.2f}x | {100 * tot[3] / tot[1]:.1f}% | {1e6 * tot[3] / tot[0]:.0f} | {tot[5]}/{tot[6]} |"
    )
