"""triton/bench.py: its prompts come from the prompt sets."""
from __future__ import annotations

from eagle_deploy.common.prompts import prompt_set
from eagle_deploy.triton.bench import bench_prompts


def test_the_triton_bench_prompts_cover_six_chat_categories():
    chat = prompt_set("chat")
    texts = bench_prompts()
    cats = [next(r["category"] for r in chat if r["prompt"] == t) for t in texts]
    assert len(texts) == 6 and len(set(cats)) == 6 and "coding" in cats
