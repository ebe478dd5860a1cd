"""The reference model's skill figures: held-out additions, code from a Chinese comment, chat, functions.

Greedy generation and log-likelihood scoring on a loaded model, as results/reference.json reports them
(benchmarks reuse `greedy_completions`).
"""

from __future__ import annotations

import torch

from pipelines.core.params_sections import ReferenceParams
from pipelines.text import synthetic
from pipelines.text.corpus import Corpus
from pipelines.text.probes import chat_items


@torch.no_grad()
def greedy_completions(model, tokenizer, prompts: list[str], max_new_tokens: int, until: tuple[str, ...] = ("\n",),
                       batch_size: int = 64) -> list[str]:
    """Each prompt's greedy completion, cut at </s> and at the first of `until` (left padding, restored after)."""
    completions = []
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    try:
        for start in range(0, len(prompts), batch_size):
            batch = tokenizer(prompts[start : start + batch_size], return_tensors="pt", padding=True,
                              add_special_tokens=False).to(model.device)
            out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
            for row in out[:, batch["input_ids"].shape[1] :]:
                text = tokenizer.decode(row, skip_special_tokens=False)
                for stop in (tokenizer.eos_token or "</s>", *until):
                    text = text.split(stop)[0]
                completions.append(text)
    finally:
        tokenizer.padding_side = side
    return completions


def greedy_exact_match(model, tokenizer, pairs: list[tuple[str, str]], max_new_tokens: int, batch_size: int = 64) -> float:
    """Share of prompts whose greedy completion, up to </s> or a newline, equals the answer (spaces ignored)."""
    completions = greedy_completions(model, tokenizer, [p for p, _ in pairs], max_new_tokens, ("\n",), batch_size)
    return sum(c.replace(" ", "") == want.replace(" ", "") for c, (_, want) in zip(completions, pairs)) / len(pairs)


@torch.no_grad()
def choice_logprob(model, tokenizer, context: str, continuation: str) -> float:
    """Sum of log-probabilities of `continuation` after `context` (what lm-eval's acc uses)."""
    ctx = tokenizer(context, add_special_tokens=False)["input_ids"]
    cont = tokenizer(continuation, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([ctx + cont])
    logprobs = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
    targets = ids[0, 1:]
    picked = logprobs[torch.arange(len(targets)), targets]
    return picked[len(ctx) - 1 :].sum().item()


def multiple_choice_accuracy(model, tokenizer, items: list[dict]) -> float:
    """Share of items whose gold choice has the highest byte-normalised log-likelihood (acc_norm)."""
    correct = 0
    for item in items:
        scores = [
            choice_logprob(model, tokenizer, item["context"], c) / max(1, len(c.encode()))
            for c in item["choices"]
        ]
        correct += max(range(len(scores)), key=scores.__getitem__) == item["gold"]
    return correct / len(items)


def skill_report(model, tokenizer, corpus: Corpus, p: ReferenceParams) -> dict:
    """The figures results/reference.json holds, with the chance level beside each."""
    _, held_out_functions = synthetic.split_function_cases(p.seed)
    pass_rate = function_pass_rate(model, tokenizer, held_out_functions[: p.eval_items])
    talk_items = chat_items(corpus.chat, p.seed, p.eval_items)
    _, held_commented = synthetic.split_commented_cases(p.seed)
    commented = [synthetic.commented_function(*case)[:2] for case in held_commented[: p.eval_items]]
    additions = [(f"{a}+{b}=", str(a + b)) for a, b in corpus.held_out_additions]
    return {
        "addition_exact_match": round(greedy_exact_match(model, tokenizer, additions, 4, 256), 4),
        "addition_items": len(additions),
        "code_comment_accuracy": round(greedy_exact_match(model, tokenizer, commented, 12), 4),
        "code_comment_items": len(commented),
        "chat_accuracy": round(multiple_choice_accuracy(model, tokenizer, talk_items), 4),
        "chat_items": len(talk_items),
        "chat_chance": 0.25,
        "function_pass_rate": None if pass_rate is None else round(pass_rate, 4),
        "function_items": min(len(held_out_functions), p.eval_items),
    }



@torch.no_grad()
def function_pass_rate(model, tokenizer, cases: list[tuple[str, int]], batch_size: int = 64) -> float:
    """Greedy completion of each held-out function's body, executed against its tests in the sandbox.

    None when the sandbox cannot isolate on this machine: model-written code never runs unisolated here.
    """
    from pipelines.core.sandbox import isolation_available, run_python

    if not isolation_available():
        return None
    passed = 0
    for start in range(0, len(cases), batch_size):
        chunk = cases[start : start + batch_size]
        for t, n in chunk:
            prompt = synthetic.function_source(t, n).rsplit("return", 1)[0] + "return"
            ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
            out = model.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=tokenizer.pad_token_id)
            completion = tokenizer.decode(out[0, ids.shape[1]:]).split("</s>")[0].split("\n")[0]
            program = prompt + completion + "\n" + synthetic.function_tests(t, n)
            passed += run_python(program).passed
    return passed / len(cases)
