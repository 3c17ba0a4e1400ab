"""The transformers reference rows of ``benchmarks/engine.py``.

transformers (``AutoModelForCausalLM`` from the same GGUF): prefill is one forward of the
1,024-token prompt (``use_cache=False``, last logits only); decode is ``generate`` (greedy,
``min_new_tokens = max_new_tokens``) at batch 1 and 8 on 512-token prompts, reported as
decode tokens per second with the prefill subtracted: ``B * (N - 1) / (t(N) - t(1))`` where
``t(n)`` is a ``generate`` of ``n`` new tokens (``*_generate_tok_s_*`` is ``B * N / t(N)``,
prefill included).

Sizes and the timer come from ``engine_common.py``; ``engine.py`` runs it after our rows
(``engine_ours.py``), with the same random generator.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from benchmarks.engine_common import Sizes, median_seconds


def measure_transformers(
    path: Path, dtype: torch.dtype, sz: Sizes, gen: torch.Generator, vocab: int
) -> dict[str, float]:
    import transformers

    transformers.logging.set_verbosity_error()
    t0 = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=dtype
    )
    model.eval()
    out: dict[str, float] = {"tf_load_s": time.perf_counter() - t0}
    ids = torch.randint(0, vocab, (1, sz.prefill_one), generator=gen)

    def prefill() -> None:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False, logits_to_keep=1)

    out["tf_prefill_tok_s_1x1024"] = sz.prefill_one / median_seconds(prefill, sz.reps)
    pad = model.generation_config.eos_token_id
    pad = pad[0] if isinstance(pad, list) else pad
    for bsz in sz.tf_decode_batches:
        prompt = torch.randint(0, vocab, (bsz, sz.decode_ctx), generator=gen)

        def generate(n: int, prompt: torch.Tensor = prompt) -> None:
            with torch.no_grad():
                model.generate(
                    input_ids=prompt,
                    attention_mask=torch.ones_like(prompt),
                    do_sample=False,
                    max_new_tokens=n,
                    min_new_tokens=n,
                    pad_token_id=pad,
                )

        t_n = median_seconds(lambda g=generate: g(sz.decode_steps), sz.reps)
        t_1 = median_seconds(lambda g=generate: g(1), sz.reps)
        if t_n > t_1:
            out[f"tf_decode_tok_s_batch{bsz}"] = bsz * (sz.decode_steps - 1) / (t_n - t_1)
        else:  # timing noise swamped the decode steps (tiny --quick sizes): no subtraction
            out[f"tf_decode_tok_s_batch{bsz}"] = bsz * sz.decode_steps / t_n
        out[f"tf_generate_tok_s_batch{bsz}"] = bsz * sz.decode_steps / t_n
    return out
