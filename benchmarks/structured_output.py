"""What a JSON-schema constraint costs: the same requests constrained and free, with the same number of output
tokens each (the free run gets each constrained output's length, ignore_eos), alternated; plus how many
constrained outputs parse and follow the schema. The embedded model, the default engine.

Run: `PYTHONPATH=. .venv/bin/python benchmarks/structured_output.py [num_requests] [rounds]`
"""

from __future__ import annotations

import json
import sys
import time

from kvserve import LLM, SamplingParams
from kvserve.platform import cpu_info
from kvserve.sampling_params import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
        "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "hobbies"],
    "additionalProperties": False,
}


def follows_schema(text: str) -> bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return (
        set(value) == {"name", "age", "city", "hobbies"}
        and isinstance(value["age"], int)
        and all(isinstance(h, str) for h in value["hobbies"])
    )


def main(num_requests: int, rounds: int) -> None:
    info = cpu_info()
    print(f"{info.model_name}; {info.describe()}")
    llm = LLM()
    names = ["Alice", "Bob", "Chen", "Dana", "Emil", "Fatima", "Goro", "Hana"]
    conversations = [
        [{"role": "user", "content": f"Describe a person called {names[i % len(names)]} number {i} as JSON."}]
        for i in range(num_requests)
    ]
    constrained = SamplingParams(
        temperature=0.0, max_tokens=160, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    outs = llm.chat(conversations, constrained, use_tqdm=False)  # warm-up, and the lengths
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    valid = sum(follows_schema(o.outputs[0].text) for o in outs)
    print(
        f"constrained outputs: {valid}/{num_requests} parse and follow the schema; "
        f"finish reasons {sorted({o.outputs[0].finish_reason for o in outs})}; {sum(lengths)} tokens"
    )
    free = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    rates: dict[str, list[float]] = {"constrained": [], "free": []}
    for _ in range(rounds):
        for label, params in (("constrained", constrained), ("free", free)):
            start = time.perf_counter()
            got = llm.chat(conversations, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            assert sum(len(o.outputs[0].token_ids) for o in got) == sum(lengths)
            rates[label].append(sum(lengths) / elapsed)
    for label, values in rates.items():
        print(f"{label}: output tok/s {[round(v, 1) for v in values]}")
    ratio = sorted(rates["constrained"])[len(values) // 2] / sorted(rates["free"])[len(values) // 2]
    print(f"constrained / free (medians): {ratio:.3f}")


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:]]
    main(args[0] if args else 32, args[1] if len(args) > 1 else 3)
