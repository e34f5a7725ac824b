#!/usr/bin/env python3
"""Deterministic generator of a synthetic TRAINING prompt set (stdlib only, no network).

Prompts are built from templates and topic lists written for this project.
Categories: writing, roleplay, reasoning, math, coding, extraction, stem, humanities
(~35% coding). Seeded with random.Random(0): identical output for identical arguments.

Usage: python make_train_prompts.py --out train_prompts.jsonl [--n N] [--exclude FILE.jsonl ...]

Disjointness: a generated prompt is dropped if its normalised text (lowercase, collapsed
whitespace) equals, or shares any 8-word shingle with, a prompt in an --exclude file.
"""
import argparse
import json
import random
import re

CATS = ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"]
SHINGLE = 8

# ----------------------------------------------------------------------------- shared lists
NAMES = ["Alice", "Bilal", "Chen", "Dara", "Elena", "Farid", "Greta", "Hiro", "Ines", "Jonas",
         "Kemi", "Luca", "Mira", "Nils", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tara",
         "Uma", "Victor", "Wen", "Yusuf", "Zoe"]
CITIES = ["Lisbon", "Nairobi", "Osaka", "Denver", "Krakow", "Lima", "Hanoi", "Dublin", "Perth",
          "Montreal", "Tunis", "Bergen", "Porto", "Quito", "Seville"]
SUBJECTS = ["a clockmaker who can pause time for one minute a day", "a dog waiting at a train station",
            "two rival bakers in a small village", "a child who finds a map in a library book",
            "the last tree in a futuristic city", "a robot learning to paint", "a lost umbrella",
            "a retired astronaut planting a garden", "a fox who befriends a farmer",
            "a lighthouse that turns itself on", "a letter delivered fifty years late",
            "a musician who loses her hearing", "a snowstorm that traps strangers in a cafe",
            "an old bicycle that remembers its riders", "a detective who is afraid of the dark",
            "a city where it never stops raining", "a grandmother teaching her grandson to fish",
            "a ghost who is bad at haunting", "a student's first day at a new school",
            "a kite that flies away with a message", "a chess game between two old friends",
            "a shipwrecked cook", "a market that only opens at midnight", "a dragon who collects teacups",
            "an inventor whose machines never work on the first try", "a migrating bird",
            "a family moving to a new country", "a forgotten toy in an attic",
            "a mountain village preparing for winter", "a space station gardener"]
TONES = ["formal", "friendly", "humorous", "persuasive", "concise", "enthusiastic", "polite",
         "professional", "warm", "neutral"]
AUDIENCES = ["a ten-year-old", "a complete beginner", "a busy manager", "a high-school student",
             "a retired engineer", "someone who speaks English as a second language",
             "a first-year university student", "a curious grandparent"]

# ----------------------------------------------------------------------------- writing
W_FORMS = ["short story", "haiku", "limerick", "six-line poem", "diary entry", "fable",
           "two-paragraph story", "dialogue scene", "song chorus", "sonnet", "flash fiction piece under 150 words"]
W_EMAIL_TO = ["your landlord", "a new colleague", "your child's teacher", "a customer",
              "a hiring manager", "a local newspaper", "your neighbour", "a hotel", "your team",
              "a conference organiser"]
W_EMAIL_ABOUT = ["a broken heating system", "rescheduling a meeting", "a missed delivery",
                 "a volunteering opportunity", "a refund request", "a noise complaint",
                 "a project deadline extension", "a thank-you for their help",
                 "an upcoming community event", "a job application follow-up", "a room booking"]
PRODUCTS = ["a solar-powered phone charger", "a folding bicycle", "a smart plant pot",
            "noise-cancelling headphones", "a handmade wool scarf", "a board game about trains",
            "a recipe app for students", "an electric kettle with temperature control",
            "a waterproof hiking backpack", "a language-learning podcast", "a standing desk",
            "a reusable coffee cup"]
SENTENCES = ["The meeting was moved because nobody could come.",
             "We regret to inform you that your order is late.",
             "The park is nice but it is too crowded on weekends.",
             "I think we should maybe consider changing the plan a little.",
             "The software update broke several features people liked.",
             "Our team worked hard and finished the project early.",
             "Please stop leaving dirty dishes in the office sink.",
             "The museum has many old things that are interesting."]


def gen_writing(r):
    k = r.randrange(6)
    if k == 0:
        return f"Write a {r.choice(W_FORMS)} about {r.choice(SUBJECTS)}."
    if k == 1:
        return (f"Draft a {r.choice(TONES)} email to {r.choice(W_EMAIL_TO)} about "
                f"{r.choice(W_EMAIL_ABOUT)}. Keep it under {r.choice([80, 100, 120, 150, 200])} words.")
    if k == 2:
        return (f"Write a {r.choice(TONES)} product description for {r.choice(PRODUCTS)} "
                f"aimed at {r.choice(AUDIENCES)}.")
    if k == 3:
        return f"Rewrite the following sentence to sound more {r.choice(TONES)}: \"{r.choice(SENTENCES)}\""
    if k == 4:
        return (f"Write the opening {r.choice(['sentence', 'paragraph', 'two paragraphs'])} of a "
                f"{r.choice(['mystery', 'comedy', 'fantasy', 'science fiction', 'romance', 'adventure'])} "
                f"story set in {r.choice(CITIES)} featuring {r.choice(SUBJECTS)}.")
    return (f"Give me {r.choice(['three', 'five', 'seven'])} title ideas for a "
            f"{r.choice(W_FORMS)} about {r.choice(SUBJECTS)}.")


# ----------------------------------------------------------------------------- roleplay
PERSONAS = ["a medieval blacksmith", "a cheerful museum guide", "a strict but fair football coach",
            "a pirate captain", "a Victorian detective", "a friendly librarian", "a nervous first-time pilot",
            "a wise old gardener", "a customer-service agent for an airline", "a time traveller from 2300",
            "a travel agent", "a personal fitness trainer", "a ship's cook", "a space-station commander",
            "a village healer", "a stand-up comedian", "a barista at a busy cafe", "a park ranger",
            "a job interviewer at a tech start-up", "a language tutor", "a mountain guide", "a chess grandmaster"]
RP_SITUATIONS = ["A customer asks for advice on choosing a gift.",
                 "Someone has just arrived late and is apologising.",
                 "A visitor asks what the most important thing you have learned is.",
                 "A child asks you why the sky changes colour at sunset.",
                 "I tell you I am nervous about an exam tomorrow.",
                 "A stranger asks for directions to the nearest station.",
                 "A newcomer asks what a typical day in your job looks like.",
                 "I complain that my order is wrong.",
                 "A reporter asks you about your biggest mistake.",
                 "A traveller asks you to recommend a place to eat."]


def gen_roleplay(r):
    k = r.randrange(4)
    p = r.choice(PERSONAS)
    if k == 0:
        return f"You are {p}. {r.choice(RP_SITUATIONS)} Respond in character."
    if k == 1:
        return f"Pretend you are {p} and explain {r.choice(STEM_TOPICS)} to {r.choice(AUDIENCES)}, staying in character."
    if k == 2:
        return (f"Act as {p}. Greet me as if I had just walked into your "
                f"{r.choice(['shop', 'office', 'camp', 'classroom', 'workshop'])} in {r.choice(CITIES)}, "
                f"then ask me {r.choice(['one', 'two', 'three'])} questions.")
    return (f"Let's role-play: you are {p} and I am {r.choice(PERSONAS)}. "
            f"Start the conversation about {r.choice(W_EMAIL_ABOUT)}.")


# ----------------------------------------------------------------------------- reasoning
def gen_reasoning(r):
    k = r.randrange(6)
    a, b, c = r.sample(NAMES, 3)
    if k == 0:
        adj = r.choice(["taller", "older", "faster", "heavier", "richer"])
        return f"{a} is {adj} than {b}, and {b} is {adj} than {c}. Who is the least {adj[:-2] if adj.endswith('er') else adj}? Explain your reasoning."
    if k == 1:
        x, y, z = r.sample(["poets", "runners", "farmers", "painters", "engineers", "musicians", "chefs", "teachers"], 3)
        return f"All {x} are {y}. Some {y} are {z}. Does it follow that some {x} are {z}? Explain."
    if k == 2:
        start, step = r.randrange(1, 30), r.randrange(2, 9)
        kind = r.randrange(3)
        if kind == 0:
            seq = [start + i * step for i in range(5)]
        elif kind == 1:
            seq = [start * (step // 2 + 1) ** i for i in range(5)]
        else:
            seq = [start + i * i * step for i in range(5)]
        return f"What is the next number in the sequence {', '.join(map(str, seq))}? Explain the pattern."
    if k == 3:
        days = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
        return f"If today is {r.choice(days)}, what day of the week will it be in {r.randrange(2, 400)} days? Show how you worked it out."
    if k == 4:
        items = r.sample(["a red box", "a blue box", "a green box", "a yellow box"], 3)
        return (f"{a}, {b} and {c} each take one of {', '.join(items)}. {a} does not take {items[0]}. "
                f"{b} takes {items[1]}. Which box does each person take?")
    n = r.randrange(3, 12)
    return (f"In a room of {n} people, everyone shakes hands with everyone else exactly once. "
            f"How many handshakes happen? Explain your reasoning step by step.")


# ----------------------------------------------------------------------------- math
def gen_math(r):
    k = r.randrange(8)
    if k == 0:
        a, b = r.randrange(12, 999), r.randrange(3, 99)
        return r.choice([f"What is {a} times {b}?", f"Compute {a} multiplied by {b}.", f"Calculate {a} x {b} and show your steps."])
    if k == 1:
        p, v = r.choice([5, 10, 12, 15, 20, 25, 30, 40]), r.randrange(20, 500)
        return f"An item costs {v} euros and is discounted by {p} percent. What is the new price?"
    if k == 2:
        a, x, b = r.randrange(2, 12), r.randrange(-10, 20), r.randrange(1, 40)
        return f"Solve for x: {a}x + {b} = {a * x + b}."
    if k == 3:
        w, h = r.randrange(2, 40), r.randrange(2, 40)
        return f"A rectangle is {w} cm wide and {h} cm tall. What are its area and perimeter?"
    if k == 4:
        xs = [r.randrange(1, 100) for _ in range(r.randrange(4, 8))]
        return f"Find the mean and median of these numbers: {', '.join(map(str, xs))}."
    if k == 5:
        a, b, c, d = r.randrange(1, 9), r.randrange(2, 10), r.randrange(1, 9), r.randrange(2, 10)
        return f"What is {a}/{b} + {c}/{d}? Give the answer as a simplified fraction."
    if k == 6:
        s, t = r.randrange(30, 120), r.randrange(2, 9)
        return f"A train travels at {s} km/h for {t} hours and then {t + 1} more hours at {s - 10} km/h. How far does it go in total?"
    n = r.randrange(2, 15)
    return r.choice([f"What is {n} squared plus {n + 3} squared?", f"How many ways can {n} books be arranged on a shelf if {min(n, 3)} of them must stay together?",
                     f"What is the sum of all integers from 1 to {n * 10}?"])


# ----------------------------------------------------------------------------- coding
# (function name, signature args, description, example)
FUNCS = [
    ("count_vowels", "text: str", "int", "counts the vowels in a string", "count_vowels('banana') == 3"),
    ("reverse_words", "sentence: str", "str", "reverses the order of words in a sentence", "reverse_words('a b c') == 'c b a'"),
    ("is_palindrome", "s: str", "bool", "checks whether a string reads the same forwards and backwards, ignoring case and spaces", "is_palindrome('Never odd or even') is True"),
    ("running_total", "values: list[int]", "list[int]", "returns the cumulative sums of a list of integers", "running_total([1, 2, 3]) == [1, 3, 6]"),
    ("chunk_list", "items: list, size: int", "list[list]", "splits a list into chunks of a given size", "chunk_list([1, 2, 3], 2) == [[1, 2], [3]]"),
    ("flatten", "nested: list", "list", "flattens an arbitrarily nested list", "flatten([1, [2, [3]]]) == [1, 2, 3]"),
    ("word_frequencies", "text: str", "dict[str, int]", "counts how often each word appears in a text, case-insensitively", "word_frequencies('a A b') == {'a': 2, 'b': 1}"),
    ("second_largest", "numbers: list[int]", "int | None", "returns the second largest distinct value, or None if there is none", "second_largest([4, 1, 4, 3]) == 3"),
    ("merge_sorted", "a: list[int], b: list[int]", "list[int]", "merges two sorted lists into one sorted list without calling sort", "merge_sorted([1, 4], [2, 3]) == [1, 2, 3, 4]"),
    ("celsius_to_fahrenheit", "c: float", "float", "converts a temperature from Celsius to Fahrenheit", "celsius_to_fahrenheit(100) == 212"),
    ("digit_sum", "n: int", "int", "returns the sum of the decimal digits of a non-negative integer", "digit_sum(905) == 14"),
    ("is_leap_year", "year: int", "bool", "decides whether a year is a leap year in the Gregorian calendar", "is_leap_year(2000) is True"),
    ("remove_duplicates", "items: list", "list", "removes duplicates from a list while keeping the first occurrence order", "remove_duplicates([3, 1, 3, 2]) == [3, 1, 2]"),
    ("caesar_shift", "text: str, k: int", "str", "shifts every letter by k places in the alphabet, keeping case and leaving other characters alone", "caesar_shift('Ab!', 1) == 'Bc!'"),
    ("gcd", "a: int, b: int", "int", "computes the greatest common divisor of two integers with Euclid's algorithm", "gcd(12, 18) == 6"),
    ("primes_below", "n: int", "list[int]", "returns all prime numbers smaller than n using a sieve", "primes_below(10) == [2, 3, 5, 7]"),
    ("fizzbuzz_line", "n: int", "str", "returns 'Fizz', 'Buzz', 'FizzBuzz' or the number as text, following the usual FizzBuzz rules", "fizzbuzz_line(15) == 'FizzBuzz'"),
    ("title_case", "text: str", "str", "capitalises the first letter of every word and lowercases the rest", "title_case('hELLO wORLD') == 'Hello World'"),
    ("longest_word", "sentence: str", "str", "returns the longest word in a sentence, picking the first one on ties", "longest_word('to be or not') == 'not'"),
    ("rotate_list", "items: list, k: int", "list", "rotates a list to the right by k positions", "rotate_list([1, 2, 3], 1) == [3, 1, 2]"),
    ("pairs_with_sum", "numbers: list[int], target: int", "list[tuple[int, int]]", "finds all index pairs whose values add up to a target", "pairs_with_sum([1, 2, 3], 4) == [(0, 2)]"),
    ("binary_to_int", "bits: str", "int", "converts a string of 0s and 1s to an integer without using int(x, 2)", "binary_to_int('101') == 5"),
    ("matrix_transpose", "m: list[list[int]]", "list[list[int]]", "transposes a rectangular matrix given as a list of rows", "matrix_transpose([[1, 2], [3, 4]]) == [[1, 3], [2, 4]]"),
    ("count_islands", "grid: list[list[int]]", "int", "counts groups of connected 1s in a grid, using up, down, left and right neighbours", "count_islands([[1, 0], [0, 1]]) == 2"),
    ("parse_key_values", "line: str", "dict[str, str]", "parses a string like 'a=1;b=2' into a dictionary", "parse_key_values('a=1;b=2') == {'a': '1', 'b': '2'}"),
    ("compress_runs", "s: str", "str", "compresses runs of repeated characters, so 'aaab' becomes 'a3b1'", "compress_runs('aab') == 'a2b1'"),
    ("median", "values: list[float]", "float", "returns the median of a non-empty list of numbers", "median([3, 1, 2]) == 2"),
    ("is_anagram", "a: str, b: str", "bool", "checks whether two words are anagrams of each other, ignoring case", "is_anagram('Listen', 'silent') is True"),
    ("roman_to_int", "numeral: str", "int", "converts a Roman numeral such as 'XIV' to an integer", "roman_to_int('XIV') == 14"),
    ("days_between", "d1: str, d2: str", "int", "returns the number of days between two dates given as 'YYYY-MM-DD'", "days_between('2024-01-01', '2024-01-31') == 30"),
    ("safe_divide", "a: float, b: float", "float | None", "divides a by b and returns None instead of raising when b is zero", "safe_divide(1, 0) is None"),
    ("group_by_length", "words: list[str]", "dict[int, list[str]]", "groups words by their length", "group_by_length(['a', 'bb', 'c']) == {1: ['a', 'c'], 2: ['bb']}"),
    ("valid_brackets", "s: str", "bool", "checks whether the brackets (), [] and {} in a string are balanced", "valid_brackets('([]{})') is True"),
    ("top_k_frequent", "items: list, k: int", "list", "returns the k most common items, most frequent first", "top_k_frequent([1, 1, 2], 1) == [1]"),
    ("snake_to_camel", "name: str", "str", "converts a snake_case identifier to camelCase", "snake_to_camel('max_value') == 'maxValue'"),
    ("clamp", "x: float, lo: float, hi: float", "float", "limits a value to the closed range [lo, hi]", "clamp(5, 0, 3) == 3"),
    ("mask_email", "email: str", "str", "hides all but the first character of the user part of an email address", "mask_email('anna@x.org') == 'a***@x.org'"),
    ("interleave", "a: list, b: list", "list", "interleaves two lists, appending leftovers from the longer one", "interleave([1, 3], [2]) == [1, 2, 3]"),
    ("collatz_steps", "n: int", "int", "counts how many Collatz steps it takes for a positive integer to reach 1", "collatz_steps(6) == 8"),
    ("histogram_text", "counts: dict[str, int]", "str", "draws a simple text histogram with one line of asterisks per key", "histogram_text({'a': 2}) == 'a: **'"),
]
FN_PHRASES = ["Write a Python function that {d}.", "Implement a Python function `{n}` that {d}.",
              "Can you write Python code for a function named {n} that {d}?",
              "I need a Python helper that {d}. Please write it.", "Create a function in Python which {d}.",
              "Using only the standard library, write a Python function that {d}."]
FN_SUFFIX = ["", " Include type hints.", " Add a docstring and two example calls.", " Explain the time complexity.",
             " Also write three unit tests with pytest.", " Keep it under 15 lines.", " Handle empty input gracefully.",
             " Do not use any imports."]
CLASSES = [("Stack", "a stack with push, pop, peek and is_empty methods"),
           ("BankAccount", "a bank account with deposit, withdraw (refusing overdrafts) and a balance property"),
           ("Inventory", "a shop inventory that adds items, removes items and reports low-stock items"),
           ("Matrix2D", "a 2x2 matrix supporting addition, multiplication and determinant"),
           ("LRUCache", "a fixed-capacity least-recently-used cache with get and put"),
           ("TodoList", "a to-do list that can add tasks, mark them done and list pending tasks"),
           ("Temperature", "a temperature value that can be read in Celsius, Fahrenheit and Kelvin"),
           ("Queue", "a first-in first-out queue built on two stacks"),
           ("Library", "a library that tracks books, borrowers and due dates"),
           ("Vector2", "a 2D vector with addition, scaling, length and dot product"),
           ("Timer", "a context manager that measures elapsed wall-clock time"),
           ("Counter", "a word counter that can be updated with new text and report the most common words"),
           ("Polynomial", "a polynomial with integer coefficients that can be evaluated and added"),
           ("RateLimiter", "a rate limiter that allows at most n calls per time window")]
CLASS_PHRASES = ["Write a Python class `{n}` representing {d}.", "Implement {d} as a Python class called {n}.",
                 "Design a Python class named {n} for {d}. Include a short usage example.",
                 "Write a Python dataclass-based or regular class `{n}` modelling {d}, with docstrings."]
BUGS = [("def {n}(values):\n    total = 0\n    for i in range(1, len(values)):\n        total += values[i]\n    return total", "return the sum of a list"),
        ("def {n}(values):\n    best = 0\n    for v in values:\n        if v > best:\n            best = v\n    return best", "return the maximum of a list that may contain only negative numbers"),
        ("def {n}(text):\n    return text[::-1] == text.lower()[::-1]", "check whether a string is a palindrome ignoring case"),
        ("def {n}(items, x):\n    lo, hi = 0, len(items)\n    while lo < hi:\n        mid = (lo + hi) // 2\n        if items[mid] < x:\n            lo = mid\n        else:\n            hi = mid\n    return lo", "find the insertion point of x in a sorted list"),
        ("def {n}(n):\n    if n == 0:\n        return 1\n    return n * {n}(n)", "compute the factorial of n"),
        ("def {n}(words, seen=[]):\n    for w in words:\n        if w not in seen:\n            seen.append(w)\n    return seen", "return the unique words of each call's input in order"),
        ("def {n}(values):\n    return sum(values) / len(values) - 1", "return the average of a list of numbers"),
        ("def {n}(d):\n    for k in d:\n        if d[k] is None:\n            del d[k]\n    return d", "remove keys whose value is None from a dictionary"),
        ("def {n}(s):\n    count = 0\n    for ch in s:\n        if ch in 'aeiou':\n            count =+ 1\n    return count", "count the vowels in a string"),
        ("def {n}(a, b):\n    while b:\n        a = b\n        b = a % b\n    return a", "compute the greatest common divisor of two numbers")]
BUG_NAMES = ["total", "helper", "process", "compute", "solve", "f", "calc", "do_work", "run", "check"]
BUG_PHRASES = ["This Python function should {d}, but it has a bug. Find and fix it:\n\n```python\n{c}\n```",
               "Fix the bug in this code, which is meant to {d}:\n\n```python\n{c}\n```",
               "My function is supposed to {d} but gives wrong results. What is wrong?\n\n```python\n{c}\n```",
               "Review the following Python code (intended to {d}), explain the mistake and give a corrected version:\n\n```python\n{c}\n```"]


def fn_body_hint(name, args):
    return f"def {name}({args}):\n    ..."


def gen_coding(r):
    k = r.choices(range(5), weights=[40, 12, 14, 12, 22])[0]
    n, args, ret, d, ex = r.choice(FUNCS)
    if k == 0:
        return r.choice(FN_PHRASES).format(n=n, d=d) + r.choice(FN_SUFFIX)
    if k == 1:
        cn, cd = r.choice(CLASSES)
        return r.choice(CLASS_PHRASES).format(n=cn, d=cd) + r.choice(["", " Add type hints.", " Include unit tests.", " Keep it simple."])
    if k == 2:
        code, bd = r.choice(BUGS)
        bn = r.choice(BUG_NAMES)
        return r.choice(BUG_PHRASES).format(d=bd, c=code.replace("{n}", bn))
    if k == 3:
        code, bd = r.choice(BUGS)
        bn = r.choice(BUG_NAMES)
        return (r.choice(["Add a clear docstring to this Python function", "Write a Google-style docstring for this function",
                          "Add a docstring and type hints to the following function"])
                + r.choice([".", " and say what it does.", ", then suggest one improvement."])
                + f"\n\n```python\n{code.replace('{n}', bn)}\n```")
    # HumanEval-style completion: signature + docstring written for this project.
    style = r.randrange(3)
    if style == 0:
        doc = f'    """Return the result of a function that {d}.\n\n    Example: {ex}\n    """'
    elif style == 1:
        doc = f'    """{d[0].upper() + d[1:]}.\n    """'
    else:
        doc = f'    """Task: {d}.\n    Check: {ex}\n    """'
    lead = r.choice(["Complete this Python function:", "Finish the implementation below.",
                     "Fill in the body of this function so that it matches its docstring:", "Implement the following:"])
    return f"{lead}\n\n```python\ndef {n}({args}) -> {ret}:\n{doc}\n```"


# ----------------------------------------------------------------------------- extraction
ITEMS = ["laptops", "chairs", "notebooks", "printers", "monitors", "desks", "cables", "lamps"]


def make_text(r):
    a, b = r.sample(NAMES, 2)
    city = r.choice(CITIES)
    day, month = r.randrange(1, 29), r.choice(["March", "April", "May", "June", "September", "October"])
    qty, item, price = r.randrange(2, 60), r.choice(ITEMS), r.randrange(20, 900)
    return r.choice([
        f"On {day} {month}, {a} met {b} in {city} to discuss an order of {qty} {item} at {price} euros each. {b} agreed to deliver them within two weeks.",
        f"{a} from the {city} office emailed {b} on {month} {day}: the shipment of {qty} {item} was delayed, and the invoice of {qty * price} euros will be sent later.",
        f"Meeting notes ({day} {month}): attendees {a}, {b}. Decision: buy {qty} {item} for the {city} branch, budget {qty * price} euros. Next review in {r.randrange(2, 8)} weeks.",
        f"Hi {b}, this is {a}. I'll arrive in {city} on {month} {day} at {r.randrange(7, 20)}:00. Could you reserve {qty} {item} for the workshop? Thanks!",
    ])


def gen_extraction(r):
    what = r.choice(["all person names", "every date", "all numbers and what they refer to", "the city mentioned",
                     "the names, dates and amounts", "any action items", "the item and quantity"])
    fmt = r.choice(["as JSON", "as a bulleted list", "as a CSV line", "in a table", "as key: value pairs"])
    lead = r.choice(["Extract {w} from the text below and return them {f}.", "From the following text, pull out {w} {f}.",
                     "Read this and list {w} {f}."])
    return lead.format(w=what, f=fmt) + f"\n\nText: {make_text(r)}"


# ----------------------------------------------------------------------------- stem
STEM_TOPICS = ["photosynthesis", "plate tectonics", "the water cycle", "how vaccines work", "black holes",
               "the greenhouse effect", "DNA replication", "Newton's laws of motion", "electric circuits",
               "the periodic table", "entropy", "natural selection", "how batteries store energy", "radioactive decay",
               "the speed of light", "ocean tides", "how the heart pumps blood", "machine learning",
               "prime numbers", "public-key cryptography", "how GPS works", "the immune system", "climate feedback loops",
               "acids and bases", "sound waves", "the Doppler effect", "compound interest", "probability",
               "how a refrigerator works", "the structure of an atom", "semiconductors", "how the internet routes data",
               "the nitrogen cycle", "lunar phases", "friction", "magnetism", "cell division", "enzymes",
               "renewable energy", "binary numbers"]
STEM_PAIRS = [("mass", "weight"), ("a virus", "a bacterium"), ("speed", "velocity"), ("weather", "climate"),
              ("mitosis", "meiosis"), ("AC", "DC current"), ("an element", "a compound"), ("heat", "temperature"),
              ("RAM", "storage"), ("fission", "fusion"), ("correlation", "causation"), ("a comet", "an asteroid"),
              ("an algorithm", "a program"), ("latitude", "longitude")]


def gen_stem(r):
    k = r.randrange(8)
    t = r.choice(STEM_TOPICS)
    if k == 0:
        return f"Explain {t} to {r.choice(AUDIENCES)}."
    if k == 1:
        a, b = r.choice(STEM_PAIRS)
        return f"What is the difference between {a} and {b}? Give {r.choice(['one', 'two'])} everyday example."
    if k == 2:
        return f"Summarise the key ideas of {t} in {r.choice([3, 4, 5])} bullet points."
    if k == 3:
        return f"What is a common misconception about {t}, and what is actually true?"
    if k == 4:
        return f"Describe a simple experiment or demonstration that illustrates {t}."
    if k == 5:
        return f"Give {r.choice(['two', 'three', 'four'])} real-world applications of {t} and explain each briefly."
    if k == 6:
        return f"Write a {r.choice([3, 4, 5])}-question quiz about {t} for {r.choice(AUDIENCES)}, with answers."
    return f"Explain {t} using an everyday analogy{r.choice(['', ', then point out where the analogy breaks down'])}."


# ----------------------------------------------------------------------------- humanities
EVENTS = ["the French Revolution", "the fall of the Western Roman Empire", "the Industrial Revolution",
          "the invention of the printing press", "the Renaissance", "the abolition of slavery in the British Empire",
          "the Meiji Restoration", "the end of the Cold War", "the Silk Road trade", "the Reformation",
          "the independence of India", "the Black Death", "the Apollo moon landing", "the founding of the United Nations",
          "the spread of the Mongol Empire", "the Scientific Revolution", "the women's suffrage movement"]
WORKS = ["Homer's Odyssey", "Shakespeare's Hamlet", "Jane Austen's Pride and Prejudice", "Orwell's 1984",
         "Mary Shelley's Frankenstein", "Cervantes' Don Quixote", "Tolstoy's War and Peace", "Dante's Inferno",
         "Chinua Achebe's Things Fall Apart", "Dickens' Great Expectations", "Kafka's The Metamorphosis"]
THEMES = ["ambition", "identity", "power", "justice", "love and duty", "social class", "freedom", "memory", "isolation"]
THINKERS = ["Socrates", "Confucius", "Aristotle", "Kant", "Simone de Beauvoir", "John Stuart Mill", "Hannah Arendt",
            "Ibn Khaldun", "Descartes", "Hume"]


def gen_humanities(r):
    k = r.randrange(6)
    if k == 0:
        return f"Summarise the main causes of {r.choice(EVENTS)}."
    if k == 1:
        a, b = r.sample(EVENTS, 2)
        return f"Compare {a} and {b}: what did they have in common, and how did they differ?"
    if k == 2:
        return f"Discuss the theme of {r.choice(THEMES)} in {r.choice(WORKS)}."
    if k == 3:
        return f"Explain the main ideas of {r.choice(THINKERS)} to {r.choice(AUDIENCES)}."
    if k == 4:
        a, b = r.sample(THINKERS, 2)
        return f"How might {a} and {b} disagree about {r.choice(THEMES)}?"
    return f"What were the long-term consequences of {r.choice(EVENTS)} for everyday life?"


GENS = {"writing": gen_writing, "roleplay": gen_roleplay, "reasoning": gen_reasoning, "math": gen_math,
        "coding": gen_coding, "extraction": gen_extraction, "stem": gen_stem, "humanities": gen_humanities}


# ----------------------------------------------------------------------------- disjointness
def norm(s):
    return re.sub(r"\s+", " ", s.lower()).strip()


def shingles(s, k=SHINGLE):
    w = norm(s).split(" ")
    return {" ".join(w[i:i + k]) for i in range(len(w) - k + 1)}


def load_exclude(paths):
    texts, sh = set(), set()
    for p in paths:
        with open(p, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    t = json.loads(line)["prompt"]
                    texts.add(norm(t))
                    sh |= shingles(t)
    return texts, sh


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=7000)
    ap.add_argument("--exclude", nargs="*", default=[])
    args = ap.parse_args()

    ex_texts, ex_sh = load_exclude(args.exclude)
    n_coding = round(args.n * 0.35)
    quota = {c: (args.n - n_coding) // 7 for c in CATS if c != "coding"}
    quota["coding"] = n_coding
    quota["writing"] += args.n - sum(quota.values())

    r = random.Random(0)
    seen, rows, dropped, dropped_by = set(), [], 0, {}
    for cat in CATS:
        got, tries = 0, 0
        while got < quota[cat] and tries < quota[cat] * 200:
            tries += 1
            p = GENS[cat](r)
            key = norm(p)
            if key in seen:
                continue
            seen.add(key)
            if key in ex_texts or (shingles(p) & ex_sh):
                dropped += 1
                dropped_by[cat] = dropped_by.get(cat, 0) + 1
                continue
            got += 1
            rows.append({"id": f"train-{cat}-{got:05d}", "category": cat, "prompt": p})
        if got < quota[cat]:
            print(f"warning: only {got}/{quota[cat]} prompts for {cat}")

    with open(args.out, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    counts = {c: sum(1 for x in rows if x["category"] == c) for c in CATS}
    print(f"wrote {len(rows)} prompts to {args.out}; dropped (overlap with exclude files): {dropped} {dropped_by}")
    print("per category:", json.dumps(counts))


if __name__ == "__main__":
    main()
