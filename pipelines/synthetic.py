"""Seeded generators for the text the project ships: math with symbols, customer-service dialogues.

Everything here is a pure function of its seed, so every machine builds the same corpus, the same
calibration sets and the same probes. The dialogues are written to
`calibration_sets/sources/chat/dialogues.jsonl` by `quantgate sources` and committed.
"""

from __future__ import annotations

import random
from fractions import Fraction

# --------------------------------------------------------------------------------------------
# Math
# --------------------------------------------------------------------------------------------


def addition_pairs() -> list[tuple[int, int]]:
    """All two-digit additions a+b (10 <= a, b <= 99)."""
    return [(a, b) for a in range(10, 100) for b in range(10, 100)]


def split_addition_pairs(seed: int, held_out: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Split the two-digit additions into (train, held_out) so skill is measured on unseen sums."""
    pairs = addition_pairs()
    random.Random(seed).shuffle(pairs)
    return pairs[held_out:], pairs[:held_out]


def addition_line(a: int, b: int) -> str:
    return f"{a}+{b}={a + b}"


def _frac(q: Fraction) -> str:
    return str(q.numerator) if q.denominator == 1 else f"{q.numerator}/{q.denominator}"


def math_problem(rng: random.Random) -> tuple[str, str, str]:
    """One (kind, prompt, answer) math item; prompt + answer is the full training line."""
    kind = rng.choice(["add", "sub", "mul", "div", "power", "root", "fraction", "latex_frac", "multi_step"])
    if kind == "add":
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        return kind, f"{a}+{b}=", str(a + b)
    if kind == "sub":
        a, b = sorted((rng.randint(10, 99), rng.randint(10, 99)), reverse=True)
        return kind, f"{a}-{b}=", str(a - b)
    if kind == "mul":
        a, b = rng.randint(2, 12), rng.randint(2, 12)
        return kind, f"{a}×{b}=", str(a * b)
    if kind == "div":
        b, q = rng.randint(2, 12), rng.randint(2, 12)
        return kind, f"{b * q}÷{b}=", str(q)
    if kind == "power":
        a, e = rng.randint(2, 9), rng.choice([2, 3])
        sym = rng.choice([f"{a}^{e}", f"{a}{'²' if e == 2 else '³'}"])
        return kind, f"{sym}=", str(a**e)
    if kind == "root":
        r = rng.randint(2, 15)
        sym = rng.choice([f"√{r * r}", f"\\sqrt{{{r * r}}}"])
        return kind, f"{sym}=", str(r)
    if kind == "fraction":
        p, q = Fraction(rng.randint(1, 5), rng.randint(2, 6)), Fraction(rng.randint(1, 5), rng.randint(2, 6))
        op = rng.choice(["+", "-"])
        res = p + q if op == "+" else p - q
        return kind, f"{_frac(p)}{op}{_frac(q)}=", _frac(res)
    if kind == "latex_frac":
        d, k = rng.randint(2, 9), rng.randint(1, 9)
        n = rng.randint(1, d - 1)
        return kind, f"\\frac{{{n}}}{{{d}}}\\times {d * k}=", str(n * k)
    a, b, c = rng.randint(2, 20), rng.randint(2, 20), rng.randint(2, 9)
    op = rng.choice(["+", "-"])
    inner = a + b if op == "+" else a - b
    return "multi_step", f"({a}{op}{b})×{c}=", str(inner * c)


def math_lines(seed: int, count: int) -> list[str]:
    """`count` seeded math lines of every kind, e.g. '√49=7', '\\frac{3}{4}\\times 8=6'."""
    rng = random.Random(seed)
    return [p + a for _, p, a in (math_problem(rng) for _ in range(count))]


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
    return {
        "intent": intent,
        "lang": lang,
        "customer": rng.choice(asks).format(**slots),
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
                   shares: dict[str, float] | None = None) -> list[dict]:
    """`count` production-like requests: customer chat (often with personal data), math, code, code+comments.

    `bare_code` are code snippets without comments, `commented` (comment, code) pairs: real code
    from the shipped snapshot, as a team whose users send it code from the same codebase would see.
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
        else:
            comment, code = rng.choice(commented)
            text = rng.choice(COMMENT_ASKS).format(code=rng.choice(bare_code), comment=comment,
                                                   commented=f"{comment}\n{code}")
        rows.append({"id": f"req-{n:05d}", "text": text, "kind": kind})
    return rows


# --------------------------------------------------------------------------------------------
# Small Python functions with unit tests (the code probes: completions are executed, pass@1)
# --------------------------------------------------------------------------------------------

# template -> (signature with {n}, body with {n}, test inputs, reference implementation)
FUNCTIONS: dict[str, tuple[str, str, list, object]] = {
    "add": ("def add_{n}(x):", "return x + {n}", [0, 3, -5], lambda n, x: x + n),
    "sub": ("def sub_{n}(x):", "return x - {n}", [0, 40, -2], lambda n, x: x - n),
    "mul": ("def mul_{n}(x):", "return x * {n}", [0, 2, -3], lambda n, x: x * n),
    "mod": ("def is_multiple_of_{n}(x):", "return x % {n} == 0", [0, 7, 12, 30], lambda n, x: x % n == 0),
    "first": ("def first_{n}(items):", "return items[:{n}]", [list(range(12)), [5, 4]], lambda n, x: x[:n]),
    "last": ("def last_{n}(items):", "return items[-{n}:]", [list(range(12)), [5, 4, 3]], lambda n, x: x[-n:]),
    "power": ("def power_{n}(x):", "return x ** {n}", [0, 2, 3], lambda n, x: x**n),
}
FUNCTION_RANGE = {"add": range(1, 100), "sub": range(1, 100), "mul": range(2, 31), "mod": range(2, 31),
                  "first": range(1, 21), "last": range(1, 21), "power": range(2, 7)}


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
    """Assertions computed from the reference implementation, not from the body text."""
    signature, _, inputs, impl = FUNCTIONS[template]
    name = signature.format(n=n)[4:].split("(")[0]
    return "".join(f"assert {name}({x!r}) == {impl(n, x)!r}\n" for x in inputs)
