"""Seeded generators for the text the project ships: small Python functions, customer-service dialogues, a traffic
sample (the math lines: pipelines/text/arithmetic.py).

Everything here is a pure function of its seed, so every machine builds the same corpus, the same
calibration sets and the same probes. The dialogues are written to
`calibration_sets/sources/chat/dialogues.jsonl` by `quantgate sources` and committed.
"""

from __future__ import annotations

import random

from pipelines.text.arithmetic import math_problem

# --------------------------------------------------------------------------------------------
# Customer-service dialogues (English and Chinese)
# --------------------------------------------------------------------------------------------

PRODUCTS_EN = ["headphones", "phone case", "coffee maker", "backpack", "desk lamp", "keyboard", "water bottle"]
PRODUCTS_ZH = ["耳机", "手机壳", "咖啡机", "背包", "台灯", "键盘", "水杯"]

# intent -> (customer phrasings, agent replies), per language. {order} and {product} are slots.
INTENTS: dict[str, dict[str, tuple[list[str], list[str]]]] = {
    "refund": {
        "en": (
            ["I want a refund for my {product}, order {order}.", "Can I get my money back for order {order}?",
             "The {product} broke after two days. I would like a refund."],
            ["I am sorry about that. I have started a refund for order {order}; it reaches your card in 3-5 days.",
             "Your refund for order {order} is approved. You will see the money within five business days."],
        ),
        "zh": (
            ["我想为订单{order}的{product}申请退款。", "订单{order}可以退款吗？", "{product}用了两天就坏了，我要退款。"],
            ["很抱歉给您带来不便。订单{order}的退款已经提交，3到5个工作日内退回原支付账户。",
             "订单{order}的退款已批准，款项将在五个工作日内到账。"],
        ),
    },
    "shipping": {
        "en": (
            ["Where is my order {order}? It has not arrived.", "My {product} is late. When will order {order} ship?",
             "Can you track order {order} for me?"],
            ["Order {order} left our warehouse yesterday and should arrive in two days. Here is the tracking link.",
             "I checked order {order}: it is with the courier and will be delivered on Friday."],
        ),
        "zh": (
            ["我的订单{order}到哪了？还没收到。", "{product}怎么还没发货？订单号{order}。", "帮我查一下订单{order}的物流。"],
            ["订单{order}昨天已从仓库发出，预计两天内送达，这是物流单号。", "我查了订单{order}，包裹在快递员手中，周五送达。"],
        ),
    },
    "password": {
        "en": (
            ["I forgot my password and cannot log in.", "How do I reset my password?",
             "My account is locked after too many login attempts."],
            ["Click 'Forgot password' on the login page and we will e-mail you a reset link valid for 30 minutes.",
             "I have unlocked your account. Please reset your password with the link we just sent."],
        ),
        "zh": (
            ["我忘记密码了，登录不上。", "怎么重置密码？", "登录失败次数太多，账号被锁了。"],
            ["请在登录页点击“忘记密码”，我们会发送一个30分钟内有效的重置链接到您的邮箱。", "账号已为您解锁，请用我们刚发送的链接重置密码。"],
        ),
    },
    "exchange": {
        "en": (
            ["The {product} is the wrong size. Can I exchange it?", "I received the wrong color {product} in order {order}.",
             "Can I swap my {product} for a different model?"],
            ["Of course. Send the {product} back with the prepaid label and we will ship the replacement right away.",
             "I have created an exchange for order {order}; the new {product} ships as soon as we scan the return."],
        ),
        "zh": (
            ["{product}尺寸不对，可以换货吗？", "订单{order}的{product}颜色发错了。", "我想把{product}换成别的型号。"],
            ["当然可以。请用预付快递单把{product}寄回，我们会立即发出新的。", "已为订单{order}创建换货单，收到退件后马上寄出新的{product}。"],
        ),
    },
    "cancel": {
        "en": (
            ["Please cancel order {order}.", "I ordered the {product} by mistake. Can I cancel?",
             "Cancel my order {order} before it ships, please."],
            ["Order {order} is cancelled and you have not been charged.",
             "Done: order {order} was cancelled before shipping. The hold on your card is released."],
        ),
        "zh": (
            ["请取消订单{order}。", "我误买了{product}，能取消吗？", "订单{order}还没发货，帮我取消。"],
            ["订单{order}已取消，不会扣款。", "已在发货前取消订单{order}，银行卡冻结金额会解除。"],
        ),
    },
    "invoice": {
        "en": (
            ["I need an invoice for order {order}.", "Can you send me a receipt for the {product}?",
             "Where can I download the invoice for order {order}?"],
            ["I have e-mailed the invoice for order {order}. You can also download it under 'My orders'.",
             "The receipt for your {product} is in your account under 'My orders', ready to download."],
        ),
        "zh": (
            ["我需要订单{order}的发票。", "能给我{product}的收据吗？", "在哪里下载订单{order}的发票？"],
            ["订单{order}的发票已发送到您的邮箱，也可以在“我的订单”中下载。", "{product}的收据在“我的订单”里，可以直接下载。"],
        ),
    },
}


def dialogue(rng: random.Random, intent: str, lang: str) -> dict:
    """One two-turn dialogue with its slots filled; the reply is the agent's turn."""
    asks, replies = INTENTS[intent][lang]
    products = PRODUCTS_EN if lang == "en" else PRODUCTS_ZH
    slots = {"order": str(rng.randint(10000, 99999)), "product": rng.choice(products)}
    ask = rng.randrange(len(asks))  # the same draw rng.choice makes; kept so probes know the phrasing
    return {
        "intent": intent,
        "lang": lang,
        "ask": ask,
        "customer": asks[ask].format(**slots),
        "agent": rng.choice(replies).format(**slots),
    }


def dialogues(seed: int, count: int) -> list[dict]:
    """`count` dialogues, intents and languages balanced, in seeded order."""
    rng = random.Random(seed)
    keys = [(i, lang) for i in sorted(INTENTS) for lang in ("en", "zh")]
    return [dialogue(rng, *keys[n % len(keys)]) for n in range(count)]


def dialogue_text(d: dict) -> str:
    """The training/calibration rendering of a dialogue."""
    return f"Customer: {d['customer']}\nAgent: {d['agent']}"


# --------------------------------------------------------------------------------------------
# A production traffic sample (what a serving team would export from its request logs)
# --------------------------------------------------------------------------------------------

PII_EN = ["You can reach me at {email}.", "My phone number is {phone_us}.", "Call me back on {phone_intl}.",
          "My SSN on the account is {ssn}.", "The card I paid with is {card}."]
PII_ZH = ["我的邮箱是{email}。", "我的手机号是{phone_cn}。", "身份证号{cn_id}。"]
NAMES = ["jane.doe", "li.wei", "m.garcia", "chen_jing", "sam.k"]
DOMAINS_MAIL = ["example.com", "mail.example.org", "corp.example.net"]

MATH_ASKS_EN = ["What is {p}?", "Compute {p}", "Please calculate {p}", "Simplify {p}", "{p}"]
MATH_ASKS_ZH = ["计算 {p}", "{p} 等于多少？"]
CODE_ASKS = ["Why does this raise an error?\n{code}", "Can you make this faster?\n{code}",
             "Rewrite this in a more idiomatic way:\n{code}", "What does this return for an empty list?\n{code}",
             "这段代码有什么问题？\n{code}"]
COMMENT_ASKS = ["Add comments to this function:\n{code}", "Write a docstring for this:\n{code}",
                "Is this comment still accurate?\n{commented}", "Explain what the comment means here:\n{commented}",
                "给这段代码加上注释：\n{code}", "Complete the code under this comment:\n{comment}\n"]
ZH_COMMENT_ASKS = ["补全这个函数：\n{prompt}", "按照注释补全代码：\n{prompt}", "这个注释和代码一致吗？\n{function}",
                   "{prompt}"]


def _pii(rng: random.Random) -> dict[str, str]:
    return {
        "email": f"{rng.choice(NAMES)}{rng.randint(1, 99)}@{rng.choice(DOMAINS_MAIL)}",
        "phone_us": f"({rng.randint(200, 989)}) {rng.randint(200, 989)}-{rng.randint(1000, 9999)}",
        "phone_intl": f"+44 20 {rng.randint(1000, 9999)} {rng.randint(1000, 9999)}",
        "phone_cn": f"1{rng.choice('3456789')}{rng.randint(100000000, 999999999)}",
        "ssn": f"{rng.randint(100, 899)}-{rng.randint(10, 99)}-{rng.randint(1000, 9999)}",
        "card": " ".join(str(rng.randint(1000, 9999)) for _ in range(4)),
        "cn_id": f"{rng.randint(110000, 659999)}{rng.randint(1960, 2005)}{rng.randint(10, 12)}"
                 f"{rng.randint(10, 28)}{rng.randint(100, 999)}{rng.choice('0123456789X')}",
    }


def traffic_sample(seed: int, count: int, bare_code: list[str], commented: list[tuple[str, str]],
                   zh_commented: list[tuple[str, str]], shares: dict[str, float] | None = None) -> list[dict]:
    """`count` production-like requests: customer chat (often with personal data), math, code, code+comments.

    `bare_code` are code snippets without comments, `commented` (comment, code) pairs: real code
    from the shipped snapshot, as a team whose users send it code from the same codebase would see;
    `zh_commented` (prompt, body) pairs of the team's own functions with Chinese comments.
    """
    shares = shares or {"chat": 0.45, "math": 0.2, "code": 0.2, "code_comment": 0.15}
    rng = random.Random(seed)
    kinds = [k for k, s in shares.items() for _ in range(round(s * count))][:count]
    rng.shuffle(kinds)
    rows = []
    for n, kind in enumerate(kinds):
        zh = rng.random() < 0.35
        if kind == "chat":
            d = dialogue(rng, rng.choice(sorted(INTENTS)), "zh" if zh else "en")
            text = d["customer"]
            if rng.random() < 0.4:
                text += (" " if not zh else "") + rng.choice(PII_ZH if zh else PII_EN).format(**_pii(rng))
        elif kind == "math":
            _, prompt, _ = math_problem(rng)
            text = rng.choice(MATH_ASKS_ZH if zh else MATH_ASKS_EN).format(p=prompt.rstrip("="))
        elif kind == "code":
            text = rng.choice(CODE_ASKS).format(code=rng.choice(bare_code))
        elif zh:
            prompt, body = rng.choice(zh_commented)
            text = rng.choice(ZH_COMMENT_ASKS).format(prompt=prompt, function=prompt + body)
        else:
            comment, code = rng.choice(commented)
            text = rng.choice(COMMENT_ASKS).format(code=rng.choice(bare_code), comment=comment,
                                                   commented=f"{comment}\n{code}")
        rows.append({"id": f"req-{n:05d}", "text": text, "kind": kind})
    return rows

# --------------------------------------------------------------------------------------------
# Small Python functions with unit tests (the code probes: completions are executed, pass@1)
# --------------------------------------------------------------------------------------------

# Test inputs that tell every number in a template's range from every other: a body that miscopies the
# number (`x == 13` for `is_31`) fails its tests (tests/test_probes.py checks this for every pair).
INTS = range(-3, 62)


def _bit_lists(limit: int) -> list[list[int]]:
    """Lists whose membership pattern spells each number below `limit` in binary: `n in items` on all of
    them tells every n from every other."""
    return [[v for v in range(limit) if v >> bit & 1] for bit in range(limit.bit_length())]


# template -> (signature with {n}, body with {n}, test inputs, reference implementation)
FUNCTIONS: dict[str, tuple[str, str, object, object]] = {
    "add": ("def add_{n}(x):", "return x + {n}", INTS, lambda n, x: x + n),
    "sub": ("def sub_{n}(x):", "return x - {n}", INTS, lambda n, x: x - n),
    "mul": ("def mul_{n}(x):", "return x * {n}", INTS, lambda n, x: x * n),
    "mod": ("def is_multiple_of_{n}(x):", "return x % {n} == 0", INTS, lambda n, x: x % n == 0),
    "first": ("def first_{n}(items):", "return items[:{n}]", [list(range(25)), [5, 4]], lambda n, x: x[:n]),
    "last": ("def last_{n}(items):", "return items[-{n}:]", [list(range(25)), [5, 4, 3]], lambda n, x: x[-n:]),
    "power": ("def power_{n}(x):", "return x ** {n}", INTS, lambda n, x: x**n),
    "div": ("def div_{n}(x):", "return x // {n}", INTS, lambda n, x: x // n),
    "rem": ("def rem_{n}(x):", "return x % {n}", INTS, lambda n, x: x % n),
    "rsub": ("def from_{n}(x):", "return {n} - x", INTS, lambda n, x: n - x),
    "max": ("def at_least_{n}(x):", "return max(x, {n})", INTS, lambda n, x: max(x, n)),
    "min": ("def at_most_{n}(x):", "return min(x, {n})", INTS, lambda n, x: min(x, n)),
    "eq": ("def is_{n}(x):", "return x == {n}", INTS, lambda n, x: x == n),
    "repeat": ("def repeat_{n}(items):", "return items * {n}", [[1, 2], []], lambda n, x: x * n),
    "gt": ("def above_{n}(x):", "return x > {n}", INTS, lambda n, x: x > n),
    "lt": ("def below_{n}(x):", "return x < {n}", INTS, lambda n, x: x < n),
    "ne": ("def is_not_{n}(x):", "return x != {n}", INTS, lambda n, x: x != n),
    "drop": ("def skip_{n}(items):", "return items[{n}:]", [list(range(25)), [5, 4]], lambda n, x: x[n:]),
    "nth": ("def item_{n}(items):", "return items[{n}]", [list(range(30)), list(range(30, 0, -1))],
            lambda n, x: x[n]),
    "twice": ("def twice_plus_{n}(x):", "return 2 * x + {n}", INTS, lambda n, x: 2 * x + n),
    "dist": ("def distance_to_{n}(x):", "return abs(x - {n})", INTS, lambda n, x: abs(x - n)),
    "shift": ("def shift_{n}(x):", "return x << {n}", INTS, lambda n, x: x << n),
    "mask": ("def mask_{n}(x):", "return x & {n}", INTS, lambda n, x: x & n),
    "count": ("def count_{n}(items):", "return items.count({n})", [[1, 2, 2, 3], *_bit_lists(20)],
              lambda n, x: x.count(n)),
    "has": ("def has_{n}(items):", "return {n} in items", _bit_lists(40), lambda n, x: n in x),
    # four more (2026-12-05): the code pool's 1,044 cases in 58 families, what compare.planning asks (docs/compare.md)
    "bor": ("def or_{n}(x):", "return x | {n}", INTS, lambda n, x: x | n),
    "bxor": ("def xor_{n}(x):", "return x ^ {n}", INTS, lambda n, x: x ^ n),
    "floor": ("def round_down_{n}(x):", "return x - x % {n}", INTS, lambda n, x: x - x % n),
    "square_plus": ("def square_plus_{n}(x):", "return x * x + {n}", INTS, lambda n, x: x * x + n),
}
FUNCTION_RANGE = {"add": range(1, 100), "sub": range(1, 100), "mul": range(2, 31), "mod": range(2, 31),
                  "first": range(1, 21), "last": range(1, 21), "power": range(2, 7), "div": range(2, 31),
                  "rem": range(2, 31), "rsub": range(1, 60), "max": range(1, 40), "min": range(1, 40),
                  "eq": range(0, 40), "repeat": range(2, 12), "gt": range(0, 40), "lt": range(0, 40),
                  "ne": range(0, 40), "drop": range(1, 21), "nth": range(0, 25), "twice": range(1, 40),
                  "dist": range(1, 40), "shift": range(1, 11), "mask": range(1, 40), "count": range(0, 20),
                  "has": range(0, 40), "bor": range(1, 40), "bxor": range(1, 40), "floor": range(2, 31),
                  "square_plus": range(1, 40)}


def function_cases() -> list[tuple[str, int]]:
    return [(t, n) for t in FUNCTIONS for n in FUNCTION_RANGE[t]]


def split_function_cases(seed: int, held_out_share: float = 0.35) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(trained, held out) function cases; the code probes use the held-out ones."""
    cases = function_cases()
    random.Random(seed).shuffle(cases)
    cut = int(len(cases) * held_out_share)
    return sorted(cases[cut:]), sorted(cases[:cut])


def function_source(template: str, n: int) -> str:
    signature, body, _, _ = FUNCTIONS[template]
    return f"{signature.format(n=n)}\n    {body.format(n=n)}"


def function_tests(template: str, n: int) -> str:
    """Assertions computed from the reference implementation, not from the body text; a range of numbers is
    checked in one assertion."""
    signature, _, inputs, impl = FUNCTIONS[template]
    name = signature.format(n=n)[4:].split("(")[0]
    if isinstance(inputs, range):
        return f"assert [{name}(x) for x in {inputs!r}] == {[impl(n, x) for x in inputs]!r}\n"
    return "".join(f"assert {name}({x!r}) == {impl(n, x)!r}\n" for x in inputs)


# --------------------------------------------------------------------------------------------
# The same small functions with Chinese comments and names that say nothing (the code-comment probes)
# --------------------------------------------------------------------------------------------

# template -> comment phrasings with {n}. Only the comment says what the function does: its name is one of
# NEUTRAL_NAMES, so a model that cannot read the comment cannot complete the body. The words are the
# comments' own (返回, 加上, 减去, 乘以, 整除, 次方, 列表 ...): no dialogue or math line uses them, so a
# calibration set without code comments never shows the quantizer these tokens' activations.
ZH_COMMENTS: dict[str, list[str]] = {
    "add": ["返回 x 加上 {n} 的结果", "把 x 加上 {n} 再返回", "计算 x 与 {n} 之和"],
    "sub": ["返回 x 减去 {n} 的结果", "把 x 减去 {n} 再返回", "计算 x 与 {n} 之差"],
    "mul": ["返回 x 乘以 {n} 的结果", "把 x 乘以 {n} 再返回", "计算 x 与 {n} 之积"],
    "mod": ["判断 x 能否被 {n} 整除", "检查 x 是否为 {n} 的倍数", "若 x 能被 {n} 整除则返回真"],
    "first": ["返回列表开头的 {n} 个元素", "取出列表的前 {n} 项", "截取列表最前面的 {n} 个元素"],
    "last": ["返回列表末尾的 {n} 个元素", "取出列表的后 {n} 项", "截取列表最后面的 {n} 个元素"],
    "power": ["返回 x 的 {n} 次方", "计算 x 的 {n} 次幂", "把 x 自乘 {n} 次方后返回"],
    "div": ["返回 x 除以 {n} 的商", "把 x 除以 {n} 后向下取整", "计算 x 与 {n} 的整数商"],
    "rem": ["返回 x 除以 {n} 的余数", "计算 x 对 {n} 取余", "求 x 模 {n} 的值"],
    "rsub": ["返回 {n} 减去 x 的结果", "用 {n} 减去 x 再返回", "计算 {n} 比 x 多出多少"],
    "max": ["返回 x 和 {n} 中较大的那个", "取 x 与 {n} 的最大值", "结果不小于 {n}，否则返回 x"],
    "min": ["返回 x 和 {n} 中较小的那个", "取 x 与 {n} 的最小值", "结果不大于 {n}，否则返回 x"],
    "eq": ["判断 x 是否等于 {n}", "检查 x 与 {n} 是否相等", "若 x 恰好为 {n} 则返回真"],
    "repeat": ["把列表重复 {n} 遍后返回", "返回列表拼接 {n} 次的结果", "将列表复制 {n} 份连在一起"],
}
NEUTRAL_NAMES = ["f", "g", "h", "calc", "compute", "helper", "transform", "value_of", "step", "apply"]


def commented_function(template: str, n: int, phrasing: int, name: str) -> tuple[str, str, str]:
    """(prompt up to `return`, body after it, the comment line) of a Chinese-commented function."""
    signature, body, _, _ = FUNCTIONS[template]
    arg = signature.split("(")[1].split(")")[0]
    comment = "# " + ZH_COMMENTS[template][phrasing].format(n=n)
    return f"def {name}({arg}):\n    {comment}\n    return", " " + body.format(n=n)[len("return "):], comment


def commented_function_cases(seed: int) -> list[tuple[str, int, int, str]]:
    """Every (template, n, phrasing, name) combination, in a seeded order."""
    cases = [(t, n, p, name) for t in ZH_COMMENTS for n in FUNCTION_RANGE[t] for p in range(len(ZH_COMMENTS[t]))
             for name in NEUTRAL_NAMES]
    random.Random(seed).shuffle(cases)
    return cases


def split_commented_cases(seed: int) -> tuple[list[tuple], list[tuple]]:
    """(trained, held out): every (template, n) pair in the held-out half is never trained on, in any
    phrasing or name, so the probes measure reading the comment, not recall."""
    pairs = sorted({(t, n) for t, n, _, _ in commented_function_cases(seed)})
    random.Random(seed + 1).shuffle(pairs)
    held = set(pairs[: len(pairs) // 2])
    cases = commented_function_cases(seed)
    return [c for c in cases if (c[0], c[1]) not in held], [c for c in cases if (c[0], c[1]) in held]
