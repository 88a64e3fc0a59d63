"""Run by test_compile_cache.py in a fresh process: build a compiled LLM, generate, and
print what the compiler did as JSON on the last line."""

from __future__ import annotations

import dataclasses
import json
import sys
import time

start = time.perf_counter()

from compilecore.counters import compilation_counter  # noqa: E402
from runtime import LLM, SamplingParams  # noqa: E402

model, cache_dir = sys.argv[1], sys.argv[2]
llm = LLM(model, compilation_config={"cache_dir": cache_dir})
params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
out = llm.generate([[5, 6, 7, 8, 9]], params, use_tqdm=False)[0]
result = {
    "tokens": out.outputs[0].token_ids,
    "time_to_first_token_s": out.metrics.first_token_time - start,
    "counters": dataclasses.asdict(compilation_counter),
}
print(json.dumps(result))
