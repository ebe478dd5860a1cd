"""The gsm8k rows and params shared by tests/test_standard_tasks.py and tests/test_standard_task_rows.py."""

from __future__ import annotations

from pipelines.core.params import Params

# (question, worked answer, final number): the shape of openai/gsm8k's rows
PROBLEMS = [
    ("Tom has 3 apples and buys 4 more. How many apples does he have?", "3 + 4 = <<3+4=7>>7", 7),
    ("A box holds 6 eggs. How many eggs are in 2 boxes?", "6 * 2 = <<6*2=12>>12", 12),
    ("Sara had 10 pens and gave away 3. How many pens are left?", "10 - 3 = <<10-3=7>>7", 7),
    ("A bus has 20 seats and 5 are empty. How many people sit on the bus?", "20 - 5 = <<20-5=15>>15", 15),
    ("Ann reads 5 pages a day for 4 days. How many pages does she read?", "5 * 4 = <<5*4=20>>20", 20),
    ("There are 9 birds and 2 fly away. How many birds stay?", "9 - 2 = <<9-2=7>>7", 7),
    ("A pack has 8 cards. How many cards are in 3 packs?", "8 * 3 = <<8*3=24>>24", 24),
    ("Ben saves 2 dollars a week for 6 weeks. How much does he save?", "2 * 6 = <<2*6=12>>12", 12),
]
SHOTS = [
    ("Mia has 2 cats and gets 1 more. How many cats does she have?", "2 + 1 = <<2+1=3>>3", 3),
    ("A pencil costs 2 dollars. How much do 5 pencils cost?", "2 * 5 = <<2*5=10>>10", 10),
    ("Leo had 7 balls and lost 4. How many balls are left?", "7 - 4 = <<7-4=3>>3", 3),
    ("A tree has 4 branches with 3 birds each. How many birds?", "4 * 3 = <<4*3=12>>12", 12),
    ("Kim ran 3 km on Monday and 5 km on Tuesday. How far did she run?", "3 + 5 = <<3+5=8>>8", 8),
]


def rows(problems):
    return [{"question": q, "answer": f"{work}\n#### {n}"} for q, work, n in problems]


def params_with_tasks(tasks: dict, **evaluate):
    """The default params with standard tasks declared where params.yaml declares them: requests.<name>.tasks."""
    requests = {name: r.model_dump(exclude_none=True) for name, r in Params().requests.items()}
    for name, specs in tasks.items():
        requests[name]["tasks"] = specs
    return Params(requests=requests, evaluate=evaluate)
