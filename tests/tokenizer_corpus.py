"""Texts the two tokenizer backends must agree on: HumanEval-style code prompts, this repository's
own source files, unicode (accents, emoji with joiners and skin tones, CJK, RTL, combining marks),
whitespace runs, control characters and the chat markup with special tokens."""
from __future__ import annotations

import itertools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# (signature, docstring lines, doctest examples): rendered the way HumanEval writes its prompts.
_FUNCTIONS = [
    ("has_close_elements(numbers: List[float], threshold: float) -> bool",
     ["Check if in given list of numbers, are any two numbers closer to each other than", "given threshold."],
     [">>> has_close_elements([1.0, 2.0, 3.0], 0.5)", "False", ">>> has_close_elements([1.0, 2.8, 3.0, 4.0, 5.0, 2.0], 0.3)", "True"]),
    ("separate_paren_groups(paren_string: str) -> List[str]",
     ["Input to this function is a string containing multiple groups of nested parentheses.",
      "Separate those group into separate strings and return the list of those."],
     [">>> separate_paren_groups('( ) (( )) (( )( ))')", "['()', '(())', '(()())']"]),
    ("truncate_number(number: float) -> float", ["Return the decimal part of the number."],
     [">>> truncate_number(3.5)", "0.5"]),
    ("below_zero(operations: List[int]) -> bool",
     ["You're given a list of deposit and withdrawal operations on a bank account that starts with",
      "zero balance. Your task is to detect if at any point the balance falls below zero."],
     [">>> below_zero([1, 2, -4, 5])", "True"]),
    ("mean_absolute_deviation(numbers: List[float]) -> float",
     ["For a given list of input numbers, calculate Mean Absolute Deviation", "MAD = average | x - x_mean |"],
     [">>> mean_absolute_deviation([1.0, 2.0, 3.0, 4.0])", "1.0"]),
    ("intersperse(numbers: List[int], delimeter: int) -> List[int]",
     ["Insert a number 'delimeter' between every two consecutive elements of input list `numbers'"],
     [">>> intersperse([], 4)", "[]", ">>> intersperse([1, 2, 3], 4)", "[1, 4, 2, 4, 3]"]),
    ("parse_nested_parens(paren_string: str) -> List[int]",
     ["For each of the group, output the deepest level of nesting of parentheses.",
      "E.g. (()()) has maximum two levels of nesting while ((())) has three."],
     [">>> parse_nested_parens('(()()) ((())) () ((())()())')", "[2, 3, 1, 3]"]),
    ("sum_product(numbers: List[int]) -> Tuple[int, int]",
     ["For a given list of integers, return a tuple consisting of a sum and a product of all the integers.",
      "Empty sum should be equal to 0 and empty product should be equal to 1."],
     [">>> sum_product([1, 2, 3, 4])", "(10, 24)"]),
    ("make_palindrome(string: str) -> str",
     ["Find the shortest palindrome that begins with a supplied string.", "Algorithm idea is simple:",
      "- Find the longest postfix of supplied string that is a palindrome."],
     [">>> make_palindrome('cata')", "'catac'"]),
    ("string_xor(a: str, b: str) -> str",
     ["Input are two strings a and b consisting only of 1s and 0s.", "Perform binary XOR on these inputs."],
     [">>> string_xor('010', '110')", "'100'"]),
    ("how_many_times(string: str, substring: str) -> int",
     ["Find how many times a given substring can be found in the original string. Count overlaping cases."],
     [">>> how_many_times('aaaa', 'aa')", "3"]),
    ("sort_numbers(numbers: str) -> str",
     ["Input is a space-delimited string of numberals from 'zero' to 'nine'.",
      "Return the string with numbers sorted from smallest to largest"],
     [">>> sort_numbers('three one five')", "'one three five'"]),
    ("rescale_to_unit(numbers: List[float]) -> List[float]",
     ["Given list of numbers (of at least two elements), apply a linear transform to that list,",
      "such that the smallest number will become 0 and the largest will become 1"],
     [">>> rescale_to_unit([1.0, 2.0, 3.0, 4.0, 5.0])", "[0.0, 0.25, 0.5, 0.75, 1.0]"]),
    ("fizz_buzz(n: int)",
     ["Return the number of times the digit 7 appears in integers less than n which are divisible by 11 or 13."],
     [">>> fizz_buzz(50)", "0", ">>> fizz_buzz(78)", "2"]),
    ("encode_cyclic(s: str)", ["returns encoded string by cycling groups of three characters."], []),
    ("prime_fib(n: int)", ["prime_fib returns n-th number that is a Fibonacci number and it's also prime."],
     [">>> prime_fib(1)", "2", ">>> prime_fib(5)", "89"]),
    ("triangle_area(a, h)", ["Given length of a side and high return area for a triangle."],
     [">>> triangle_area(5, 3)", "7.5"]),
    ("fib4(n: int)", ["The Fib4 number sequence is a sequence similar to the Fibbonacci sequnece that's defined as follows:",
                      "fib4(0) -> 0", "fib4(n) -> fib4(n-1) + fib4(n-2) + fib4(n-3) + fib4(n-4)."],
     [">>> fib4(7)", "14"]),
    ("vowels_count(s)", ['Write a function vowels_count which takes a string representing', 'a word as input and returns the number of vowels in the string.'],
     ['>>> vowels_count("ACEDY")', "3"]),
    ("circular_shift(x, shift)", ["Circular shift the digits of the integer x, shift the digits right by shift"],
     [">>> circular_shift(12, 2)", '"12"']),
]

_EXTRA_PROMPTS = [
    "#include <stdio.h>\nint main(void) {\n\tfor (int i = 0; i < 10; ++i) printf(\"%d\\n\", i * i);\n\treturn 0;\n}\n",
    "fn main() {\n    let v: Vec<u64> = (1..=10).map(|x| x.pow(2)).collect();\n    println!(\"{:?}\", v);\n}\n",
    "const add = (a, b) => a + b;\nexport default async function handler(req) {\n  return new Response(JSON.stringify({ ok: true }), { status: 200 });\n}\n",
    "SELECT id, name FROM users WHERE created_at >= '2024-01-01' AND name LIKE '%son' ORDER BY id DESC;\n",
    "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"></head><body>&nbsp;&lt;p&gt;</body></html>\n",
    "$ git commit -m 'fix: off-by-one in range(len(xs) - 1)' && git push origin HEAD:refs/for/main\n",
    "x = 1_000_000 + 0x1F - 0b1010 + 3.14e-10j; y = f\"{x!r:>20}\"; z = b'\\x00\\xff'\n",
    "    \n\n\n        \t\t  \r\n\r\n   \u00a0\u2003\u3000end",
    "I'm sure they'll say it's what we've done, and I'd agree: THEY'LL, IT'S, WE'VE, I'D, 'S 'T 'RE 'VE 'M 'LL 'D",
    "Ünïcödé façade naïve coöperate Æsir Øresund Ångström; ελληνικά; русский текст; עברית; العربية",
    "日本語のテキストと中文文本，还有한국어 텍스트。全角：ＡＢＣ１２３！",
    "emoji: 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 🇫🇷 ❤️ ✨🤖🦀🐍 1️⃣ #️⃣",
    "combining: e\u0301 a\u0308 n\u0303 Z\u0336a\u0335l\u0337g\u0334o",
    "math: ∀x∈ℝ, ∑ᵢ xᵢ² ≤ ∞; ½ ¾ ² ³ ⅷ Ⅻ ٣ ४ ௫ 𝟙𝟚𝟛",
    "control: \x00\x01\x07\x1b[31mred\x1b[0m \x1c\x1d\x1e\x1f \x7f \x85 \u200b\u200d\ufeff",
    "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.<|im_end|>\n<|im_start|>user\n"
    "Write a quicksort in Python.<|im_end|>\n<|im_start|>assistant\n",
    "<|fim_prefix|>def f(x):\n    <|fim_suffix|>\n    return y<|fim_middle|>",
    "<|endoftext|><|endoftext|>text<|im_end|<|im_end|>>",
]


def humaneval_prompts() -> list[str]:
    out = []
    for sig, doc, examples in _FUNCTIONS:
        body = "\n".join(f"    {line}" for line in [*doc, *examples])
        out.append(f"from typing import List, Tuple\n\n\ndef {sig}:\n    \"\"\" {body.lstrip()}\n    \"\"\"\n")
    return out


def whitespace_runs() -> list[str]:
    """Every mix of up to three runs of spaces, tabs, newlines and CRLFs around a word."""
    pieces = ["", " ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n", "\n ", "    "]
    return [f"{a}x{b}y{c}" for a, b, c in itertools.product(pieces, repeat=3)]


def repo_sources(limit_chars: int = 200_000) -> list[str]:
    """This repository's own Python files: real code, docstrings and shape comments."""
    out, total = [], 0
    for path in sorted([*(ROOT / "common").glob("*.py"), *(ROOT / "services").rglob("*.py")]):
        text = path.read_text(encoding="utf-8")
        out.append(text)
        total += len(text)
        if total >= limit_chars:
            break
    return out


def corpus() -> list[str]:
    return [*humaneval_prompts(), *_EXTRA_PROMPTS, *whitespace_runs(), *repo_sources()]
