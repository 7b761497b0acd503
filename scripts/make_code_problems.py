"""Write treadle/recipes/data/code_problems.jsonl: small stdin/stdout programming problems for code RL.

Each problem has a statement (with one worked example), a reference solution and five tests whose
expected outputs come from running that solution here (it is our own code, so it runs in-process).
The problems are easy on purpose (read two numbers, print an expression of them; reverse a string;
sum a list): a 135M-parameter model solves a few, which gives RL something to climb.

    python scripts/make_code_problems.py        # rewrites the JSONL deterministically
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import sys

OUT = os.path.join(os.path.dirname(__file__), "..", "treadle", "recipes", "data", "code_problems.jsonl")
TESTS_PER_PROBLEM = 5
WORDS = "apple banana level racecar python treadle noon kayak stone river lathe pedal code model".split()


def two_ints(rng: random.Random) -> str:
    return f"{rng.randint(1, 50)} {rng.randint(1, 50)}\n"


def three_ints(rng: random.Random) -> str:
    return " ".join(str(rng.randint(-20, 60)) for _ in range(3)) + "\n"


def one_int(rng: random.Random) -> str:
    return f"{rng.randint(1, 12)}\n"


def big_int(rng: random.Random) -> str:
    return f"{rng.randint(1, 99999)}\n"


def word(rng: random.Random) -> str:
    return rng.choice(WORDS) + ("" if rng.random() < 0.5 else rng.choice(WORDS)) + "\n"


def sentence(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6))) + "\n"


def int_list(rng: random.Random) -> str:
    n = rng.randint(1, 8)
    return f"{n}\n" + " ".join(str(rng.randint(-30, 30)) for _ in range(n)) + "\n"


def no_input(rng: random.Random) -> str:
    return ""


TWO = "Read two integers a and b, given on one line separated by a space, and print "
ONE = "Read an integer n and print "
LIST = "The first line holds an integer n, the second line n integers. Print "
WORD = "Read a word (one line of lowercase letters) and print "

READ_AB = "a, b = map(int, input().split())\n"
READ_N = "n = int(input())\n"
READ_LIST = "n = int(input())\nxs = list(map(int, input().split()))\n"
READ_S = "s = input().strip()\n"

# (name, statement, reference solution, input generator)
PROBLEMS = [
    ("sum_two", TWO + "their sum.", READ_AB + "print(a + b)", two_ints),
    ("difference", TWO + "a - b.", READ_AB + "print(a - b)", two_ints),
    ("product", TWO + "their product.", READ_AB + "print(a * b)", two_ints),
    ("max_two", TWO + "the larger of the two.", READ_AB + "print(max(a, b))", two_ints),
    ("min_two", TWO + "the smaller of the two.", READ_AB + "print(min(a, b))", two_ints),
    ("int_division", TWO + "the integer quotient a // b.", READ_AB + "print(a // b)", two_ints),
    ("remainder", TWO + "the remainder of a divided by b.", READ_AB + "print(a % b)", two_ints),
    ("abs_difference", TWO + "the absolute value of a - b.", READ_AB + "print(abs(a - b))", two_ints),
    ("double_sum", TWO + "two times their sum.", READ_AB + "print(2 * (a + b))", two_ints),
    ("linear_combo", TWO + "2*a + 3*b.", READ_AB + "print(2 * a + 3 * b)", two_ints),
    ("sum_of_squares", TWO + "a*a + b*b.", READ_AB + "print(a * a + b * b)", two_ints),
    ("diff_of_squares", TWO + "(a + b) * (a - b).", READ_AB + "print((a + b) * (a - b))", two_ints),
    ("product_plus_sum", TWO + "a*b + a + b.", READ_AB + "print(a * b + a + b)", two_ints),
    ("power", TWO + "a to the power of (b mod 4).", READ_AB + "print(a ** (b % 4))", two_ints),
    ("compare", TWO + "'less' if a < b, 'greater' if a > b, otherwise 'equal'.",
     READ_AB + "print('less' if a < b else 'greater' if a > b else 'equal')", two_ints),
    ("gcd", TWO + "their greatest common divisor.", "import math\n" + READ_AB + "print(math.gcd(a, b))", two_ints),
    ("lcm", TWO + "their least common multiple.", "import math\n" + READ_AB + "print(a * b // math.gcd(a, b))", two_ints),
    ("sum_range", TWO + "the sum of all integers from min(a, b) to max(a, b), inclusive.",
     READ_AB + "print(sum(range(min(a, b), max(a, b) + 1)))", two_ints),
    ("average_floor", TWO + "their average rounded down ((a + b) // 2).", READ_AB + "print((a + b) // 2)", two_ints),
    ("swap", TWO + "b and a (in that order) on one line separated by a space.", READ_AB + "print(b, a)", two_ints),
    ("double", ONE + "2 * n.", READ_N + "print(2 * n)", one_int),
    ("successor", ONE + "n + 1.", READ_N + "print(n + 1)", one_int),
    ("square", ONE + "n squared.", READ_N + "print(n * n)", one_int),
    ("cube", ONE + "n cubed.", READ_N + "print(n ** 3)", one_int),
    ("parity", ONE + "'even' if n is even and 'odd' otherwise.", READ_N + "print('even' if n % 2 == 0 else 'odd')", one_int),
    ("triangle_number", ONE + "the sum 1 + 2 + ... + n.", READ_N + "print(n * (n + 1) // 2)", one_int),
    ("factorial", ONE + "n factorial (n!).", "import math\n" + READ_N + "print(math.factorial(n))", one_int),
    ("count_up", ONE + "the numbers 1 to n, one per line.", READ_N + "for i in range(1, n + 1):\n    print(i)", one_int),
    ("count_down", ONE + "the numbers n down to 1, one per line.", READ_N + "for i in range(n, 0, -1):\n    print(i)", one_int),
    ("stars", ONE + "a line of n asterisks (*).", READ_N + "print('*' * n)", one_int),
    ("staircase", ONE + "n lines; line i (from 1) holds i asterisks.", READ_N + "for i in range(1, n + 1):\n    print('*' * i)", one_int),
    ("times_table", ONE + "n*1, n*2, ..., n*10 on one line separated by spaces.",
     READ_N + "print(*[n * i for i in range(1, 11)])", one_int),
    ("fizzbuzz", ONE + "the numbers 1 to n, one per line, but 'Fizz' for multiples of 3, 'Buzz' for multiples of 5 "
     "and 'FizzBuzz' for multiples of both.",
     READ_N + "for i in range(1, n + 1):\n    print('FizzBuzz' if i % 15 == 0 else 'Fizz' if i % 3 == 0 else 'Buzz' if i % 5 == 0 else i)",
     one_int),
    ("is_prime", ONE + "'YES' if n is prime and 'NO' otherwise.",
     READ_N + "print('YES' if n > 1 and all(n % d for d in range(2, n)) else 'NO')", one_int),
    ("digit_sum", ONE + "the sum of its decimal digits.", "print(sum(int(c) for c in input().strip()))", big_int),
    ("digit_count", ONE + "the number of its decimal digits.", "print(len(input().strip()))", big_int),
    ("reverse_number", ONE + "its digits in reverse order, as a number (no leading zeros).",
     "print(int(input().strip()[::-1]))", big_int),
    ("last_digit", ONE + "its last decimal digit.", READ_N + "print(n % 10)", big_int),
    ("reverse_word", WORD + "it reversed.", READ_S + "print(s[::-1])", word),
    ("upper", WORD + "it in upper case.", READ_S + "print(s.upper())", word),
    ("word_length", WORD + "its length.", READ_S + "print(len(s))", word),
    ("vowel_count", WORD + "how many of its letters are vowels (a, e, i, o, u).",
     READ_S + "print(sum(c in 'aeiou' for c in s))", word),
    ("first_letter", WORD + "its first letter.", READ_S + "print(s[0])", word),
    ("last_letter", WORD + "its last letter.", READ_S + "print(s[-1])", word),
    ("palindrome", WORD + "'YES' if it reads the same backwards and 'NO' otherwise.",
     READ_S + "print('YES' if s == s[::-1] else 'NO')", word),
    ("repeat_word", WORD + "it twice, with no space in between.", READ_S + "print(s + s)", word),
    ("capitalize", WORD + "it with its first letter in upper case.", READ_S + "print(s.capitalize())", word),
    ("greeting", "Read a name (one line) and print 'Hello, NAME!' with the name in place of NAME.",
     "print(f'Hello, {input().strip()}!')", word),
    ("word_count", "Read a line of words separated by single spaces and print the number of words.",
     "print(len(input().split()))", sentence),
    ("reverse_words", "Read a line of words separated by single spaces and print the words in reverse order.",
     "print(' '.join(input().split()[::-1]))", sentence),
    ("list_sum", LIST + "their sum.", READ_LIST + "print(sum(xs))", int_list),
    ("list_max", LIST + "the largest of them.", READ_LIST + "print(max(xs))", int_list),
    ("list_min", LIST + "the smallest of them.", READ_LIST + "print(min(xs))", int_list),
    ("count_even", LIST + "how many of them are even.", READ_LIST + "print(sum(x % 2 == 0 for x in xs))", int_list),
    ("sort_ascending", LIST + "them sorted in increasing order, on one line separated by spaces.",
     READ_LIST + "print(*sorted(xs))", int_list),
    ("sort_descending", LIST + "them sorted in decreasing order, on one line separated by spaces.",
     READ_LIST + "print(*sorted(xs, reverse=True))", int_list),
    ("distinct_count", LIST + "how many distinct values there are.", READ_LIST + "print(len(set(xs)))", int_list),
    ("count_positive", LIST + "how many of them are greater than zero.", READ_LIST + "print(sum(x > 0 for x in xs))", int_list),
    ("reverse_list", LIST + "them in reverse order, on one line separated by spaces.", READ_LIST + "print(*xs[::-1])", int_list),
    ("range_span", LIST + "the largest minus the smallest.", READ_LIST + "print(max(xs) - min(xs))", int_list),
    ("sum_three", "Read three integers on one line and print their sum.", "print(sum(map(int, input().split())))", three_ints),
    ("max_three", "Read three integers on one line and print the largest.", "print(max(map(int, input().split())))", three_ints),
    ("median_three", "Read three integers on one line and print the middle one when sorted.",
     "print(sorted(map(int, input().split()))[1])", three_ints),
    ("hello_world", "Print 'Hello, World!' (there is no input).", "print('Hello, World!')", no_input),
]


def run_solution(source: str, stdin: str) -> str:
    """Run our own reference solution in-process on `stdin`; returns what it printed."""
    out = io.StringIO()
    old_stdin = sys.stdin
    sys.stdin = io.StringIO(stdin)
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(source, "<solution>", "exec"), {"__name__": "__main__"})
    finally:
        sys.stdin = old_stdin
    return out.getvalue()


def make_problem(name: str, statement: str, solution: str, inputs) -> dict:
    rng = random.Random(name)
    stdins: list[str] = []
    for _ in range(100):  # distinct inputs where the generator allows; the no-input problem has one
        stdin = inputs(rng)
        if stdin not in stdins:
            stdins.append(stdin)
        if len(stdins) == TESTS_PER_PROBLEM:
            break
    tests = [{"input": s, "output": run_solution(solution, s)} for s in stdins]
    example = tests[0]
    shown_input = example["input"] if example["input"] else "(none)\n"
    full = f"{statement}\n\nExample input:\n{shown_input}Example output:\n{example['output']}"
    return {"name": name, "statement": full, "tests": tests, "solution": solution}


def main() -> None:
    names = [name for name, *_ in PROBLEMS]
    assert len(set(names)) == len(names), "problem names must be unique"
    with open(OUT, "w") as f:
        for name, statement, solution, inputs in PROBLEMS:
            f.write(json.dumps(make_problem(name, statement, solution, inputs)) + "\n")
    print(f"wrote {len(PROBLEMS)} problems to {os.path.normpath(OUT)}")


if __name__ == "__main__":
    main()
