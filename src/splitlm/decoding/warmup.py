"""A warm-up corpus for retrieval drafting: the model's own answers to generic requests.

Small models answer in a recognisable house style (how a code block opens, how a list is laid
out, which phrases start an answer). `splitlm warmup` runs the full model locally over a fixed
list of generic instructions — programming tasks in several languages, structured-data requests,
short creative pieces, everyday questions — and over snippets of Python's standard library to
continue, and stores the greedy answers. The `auto` drafter's n-gram model learns from them next
to `pydoc_data.topics`. Nothing here comes from a user; a user's own text never enters the file.

File format: gzip'd JSON lines, one {"prompt": ..., "text": ...} object per answer.
"""

from __future__ import annotations

import gzip
import itertools
import json
import random
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path

from splitlm import SplitLMError
from splitlm.decoding.warmup_more import more_instructions
from splitlm.progress import bar

WARMUP_FILE = "warmup.jsonl.gz"
BUNDLED_DIR = Path(__file__).resolve().parent.parent / "data" / "warmup"

LANGS = ["Python", "JavaScript", "TypeScript", "Go", "Rust", "Java", "C", "C++", "Ruby", "bash"]
CODE_TASKS = [
    "checks whether a string is a palindrome",
    "computes the factorial of a number",
    "finds the largest element in a list",
    "counts the vowels in a string",
    "merges two sorted lists",
    "removes duplicates from a list",
    "converts Celsius to Fahrenheit",
    "reads a file and counts its lines",
    "returns the n-th Fibonacci number",
    "checks whether a number is prime",
    "sorts a list of dictionaries by a key",
    "flattens a nested list",
    "parses a date string",
    "validates an email address",
    "computes the average of a list of numbers",
    "implements binary search",
    "capitalizes the first letter of every word",
    "finds the most common word in a text",
    "converts a number to binary",
    "computes the greatest common divisor of two numbers",
    "generates a random password",
    "checks whether two strings are anagrams",
    "sums the digits of a number",
    "transposes a matrix",
    "downloads a web page",
    "counts how often each character appears in a string",
    "splits a list into chunks of size n",
    "checks whether a year is a leap year",
    "converts a string to title case",
    "rotates a list by k places",
    "finds the second largest number in a list",
    "computes the median of a list",
    "reverses a linked list",
    "checks whether parentheses in a string are balanced",
    "converts Roman numerals to integers",
    "finds all pairs in a list that sum to a target",
    "computes the power set of a set",
    "writes a dictionary to a JSON file",
    "retries a function call three times",
    "measures how long a function takes",
    "groups words by their first letter",
    "removes punctuation from a string",
    "computes compound interest",
    "generates the first n prime numbers",
    "finds the longest word in a sentence",
    "shuffles a deck of cards",
    "counts the words in a file",
    "converts a list of tuples into a dictionary",
    "checks whether a list is sorted",
    "computes the distance between two points",
]
CODE_TASKS += [
    "computes the Levenshtein distance between two strings",
    "converts a hex colour code to RGB values",
    "returns the unique elements of a list in their original order",
    "computes the dot product of two vectors",
    "finds the missing number in a list from 1 to n",
    "checks whether a string contains only digits",
    "converts seconds into hours, minutes and seconds",
    "finds the longest common prefix of a list of strings",
    "counts the set bits in an integer",
    "returns the k largest elements of a list",
    "checks whether a number is an Armstrong number",
    "computes the area of a triangle from its three sides",
    "turns a dictionary into a URL query string",
    "parses a CSV line into fields",
    "returns the intersection of two lists",
    "pads a string to a given length",
    "computes the running total of a list",
    "finds the first repeated character in a string",
    "converts kilometres to miles",
    "builds Pascal's triangle with n rows",
    "computes the least common multiple of two numbers",
    "checks whether a matrix is symmetric",
    "sums the even numbers in a list",
    "truncates a string to n characters with an ellipsis",
    "returns the weekday of a given date",
    "merges two dictionaries",
    "counts the occurrences of a substring in a string",
    "implements bubble sort",
    "implements insertion sort",
    "implements quicksort",
    "implements merge sort",
    "checks whether a binary tree is balanced",
    "computes the depth of a binary tree",
    "finds the shortest path in a grid with breadth-first search",
    "checks a password against simple strength rules",
    "converts a camelCase name to snake_case",
    "computes the standard deviation of a list of numbers",
    "checks whether a sentence is a pangram",
    "removes all whitespace from a string",
    "finds the maximum sum of a contiguous subarray",
    "converts a list of strings to integers, skipping invalid entries",
    "counts the files in a directory",
    "returns the extension of a file path",
    "encodes a string with a Caesar cipher",
    "checks whether a number is a power of two",
    "computes the number of days between two dates",
    "finds the mode of a list of numbers",
    "pairs up the elements of two lists",
    "groups a list of records by one of their fields",
    "returns the n-th triangular number",
    "checks whether a string is a valid IPv4 address",
    "converts a list of words into an acronym",
    "computes the cumulative product of a list",
    "finds all divisors of a number",
    "returns the longest increasing subsequence of a list",
    "counts the islands in a grid of zeros and ones",
    "converts an integer to Roman numerals",
    "checks whether a graph has a cycle",
    "performs a depth-first search on a graph",
    "implements a simple hash function for strings",
    "returns the most frequent element of a list",
    "converts a temperature table from Fahrenheit to Celsius",
    "finds the peak element of an array",
    "counts the distinct words in a text, ignoring case",
    "computes the Hamming distance between two strings",
    "interleaves two strings character by character",
    "computes the moving average of a list with a window of size k",
    "returns every permutation of a string",
    "computes the binomial coefficient n choose k",
    "formats a number with thousands separators",
    "finds the first non-repeating character in a string",
    "multiplies two matrices",
    "checks whether a Sudoku row is valid",
    "converts a nested dictionary into a flat one with dotted keys",
    "returns the difference between two lists",
    "draws a text progress bar for a percentage",
    "computes a checksum of a file",
    "reads environment variables with default values",
    "simulates rolling two dice a thousand times",
    "converts an RGB colour to hexadecimal",
    "returns the largest prime factor of a number",
    "trims a list to its last n elements",
    "checks whether a number is a happy number",
    "finds the median of two sorted lists",
    "replaces every vowel in a string with a star",
    "schedules a function to run after a delay",
    "splits a full name into first and last name",
    "computes the body mass index",
    "counts the uppercase and lowercase letters in a string",
    "finds the closest pair of numbers in a list",
    "computes the sum of the squares of the first n numbers",
    "checks whether a string is a rotation of another",
    "parses a key=value configuration file",
    "returns the top three scores from a dictionary of players",
    "converts minutes into a human-readable duration",
    "checks whether a triangle is right-angled",
    "computes the total price of a shopping cart with tax",
    "compresses a string with run-length encoding",
    "validates a phone number",
    "generates a multiplication table",
]
CODE_HOWTOS = [
    "read a text file line by line",
    "sort a list of objects by an attribute",
    "handle errors",
    "make an HTTP GET request",
    "format a number with two decimals",
    "get the current date and time",
    "split a string by a delimiter",
    "check whether a key exists in a map",
    "write a unit test",
    "start a new thread",
    "parse command-line arguments",
    "convert a string to an integer",
    "iterate over the entries of a dictionary",
    "define a constant",
    "join a list of strings",
]
CODE_CONCEPTS = [
    "a closure",
    "recursion",
    "a generator",
    "a decorator",
    "a hash map",
    "a race condition",
    "a REST API",
    "Big-O notation",
    "a lambda function",
    "polymorphism",
    "inheritance",
    "a callback",
    "a promise",
    "dependency injection",
    "memoization",
    "a binary search tree",
    "a context manager",
    "an iterator",
    "garbage collection",
    "immutability",
]
CODE_CLASSES = [
    "BankAccount",
    "Rectangle",
    "Inventory",
    "TodoList",
    "Matrix",
    "Timer",
    "Library",
    "ShoppingCart",
    "Counter",
    "Temperature",
    "Circle",
    "Student",
    "Playlist",
    "Vector2D",
    "LRUCache",
    "EventBus",
    "Logger",
    "Fraction",
    "ParkingLot",
    "Deck",
]
SQL_QUERIES = [
    "the ten most recent orders",
    "the number of employees in each department",
    "all products that cost more than the average price",
    "customers who never placed an order",
    "the total sales per month in 2022",
]
FORMATS = ["JSON", "YAML", "CSV", "XML", "a Markdown table"]
RECORDS = [
    ("cars", "make, model, year"),
    ("cities", "name, country, population"),
    ("movies", "title, director, year"),
    ("students", "name, grade, score"),
    ("animals", "species, habitat, diet"),
    ("recipes", "name, cuisine, minutes"),
    ("employees", "name, role, salary"),
    ("countries", "name, capital, currency"),
    ("songs", "title, artist, length"),
    ("laptops", "brand, memory, price"),
    ("hotels", "name, stars, price per night"),
    ("flights", "number, origin, destination"),
    ("courses", "title, teacher, credits"),
    ("rivers", "name, length, continent"),
    ("phones", "model, screen size, battery"),
    ("games", "title, genre, players"),
    ("orders", "id, customer, total"),
    ("plants", "name, water needs, sunlight"),
    ("teams", "name, city, wins"),
    ("tools", "name, use, weight"),
]
CREATIVE_KINDS = [
    "a short poem",
    "a haiku",
    "a short story",
    "a limerick",
    "a diary entry",
    "a song chorus",
    "a fairy tale",
    "a short dialogue",
]
SUBJECTS = [
    "a cat who learns to swim",
    "a city under the sea",
    "the first snow of winter",
    "an old clock that runs backwards",
    "a detective who is afraid of the dark",
    "a tree that remembers everything",
    "a girl who can talk to clouds",
    "a forgotten island",
    "a friendly ghost in a library",
    "a knight who hates horses",
    "a village where it never stops raining",
    "a musician who lost his voice",
    "a dog who becomes mayor",
    "the last bookshop in town",
    "a robot gardener",
    "a lost umbrella",
    "two rival chefs",
    "a train that only runs at midnight",
    "a painter who sees sounds",
    "a grandmother's secret recipe",
    "a mountain that moves",
    "a pirate who gets seasick",
    "the night the stars went out",
    "a letter that arrives fifty years late",
]
ASKS = ["How can I {}?", "What is the best way to {}?", "Can you give me tips to {}?"]
GOALS = [
    "sleep better",
    "learn a new language",
    "save money",
    "stay motivated at work",
    "eat healthier",
    "make new friends in a new city",
    "improve my handwriting",
    "start running",
    "reduce stress",
    "write a good cover letter",
    "keep my kitchen clean",
    "learn to play the guitar",
    "be more productive in the morning",
    "prepare for an exam",
    "organise my closet",
    "talk to my boss about a raise",
    "get better at chess",
    "drink more water",
    "plan a birthday party",
    "stop procrastinating",
    "take better photos with my phone",
    "care for a new puppy",
    "cook rice properly",
    "keep a conversation going",
    "read more books",
    "fix a squeaky door",
    "choose a good laptop",
    "study for a driving test",
]
WHYS = [
    "the sky is blue",
    "leaves change colour in autumn",
    "we have seasons",
    "the sea is salty",
    "cats purr",
    "bread rises",
    "ice floats on water",
    "we dream",
    "the moon has phases",
    "volcanoes erupt",
    "onions make us cry",
    "the ocean has tides",
    "birds migrate",
    "we yawn",
    "metal feels cold",
    "thunder follows lightning",
    "the sun sets red",
    "bubbles are round",
    "our voice sounds different on recordings",
    "popcorn pops",
]
PAIRS = [
    ("a virus", "a bacterium"),
    ("weather", "climate"),
    ("RAM", "storage"),
    ("a lake", "a pond"),
    ("HTTP", "HTTPS"),
    ("a crocodile", "an alligator"),
    ("speed", "velocity"),
    ("a loan", "a mortgage"),
    ("a list", "a tuple"),
    ("baking soda", "baking powder"),
    ("a hurricane", "a tornado"),
    ("stocks", "bonds"),
    ("a frog", "a toad"),
    ("SQL", "NoSQL"),
]


MORE_RECORDS = [
    ("bridges", "name, city, length"),
    ("museums", "name, city, visitors per year"),
    ("bikes", "brand, type, gears"),
    ("birds", "species, wingspan, colour"),
    ("mountains", "name, height, country"),
    ("trains", "name, top speed, route"),
    ("cheeses", "name, country, milk"),
    ("apps", "name, category, rating"),
    ("festivals", "name, month, city"),
    ("languages", "name, speakers, family"),
]
MORE_FORMATS = ["TOML", "an HTML table"]
EMAILS = [
    "asking a colleague to review a report",
    "declining a meeting invitation politely",
    "thanking a teacher at the end of the school year",
    "asking a landlord to fix the heating",
    "following up on an unanswered message",
    "announcing a team lunch",
    "apologising for missing a call",
    "requesting a refund for a cancelled concert",
    "welcoming a new team member",
    "asking for feedback on a presentation",
    "reminding a friend about a borrowed book",
    "inviting a speaker to a school event",
    "confirming a dentist appointment",
    "telling a client about a short delay",
    "asking a neighbour to water the garden",
    "congratulating a friend on a new job",
    "asking the library to extend a loan",
    "summarising the decisions of a meeting",
    "introducing two colleagues to each other",
    "asking for a day off next Friday",
]
LISTS = [
    "tips for writing clearly",
    "ways to save energy at home",
    "healthy breakfast ideas",
    "things to pack for a weekend hike",
    "questions to ask a new doctor",
    "ways to learn new vocabulary",
    "board games for families",
    "safety rules for a chemistry lab",
    "habits of good listeners",
    "reasons to learn to swim",
    "ideas for a science fair project",
    "uses for an old glass jar",
    "ways to make a small room feel bigger",
    "things to check before a long car journey",
]
EXPLAINS = [
    "how a refrigerator keeps food cold",
    "how vaccines work",
    "how aeroplanes stay in the air",
    "what inflation is",
    "how a compass works",
    "how credit cards work",
    "how a message travels across the internet",
    "what photosynthesis is",
    "how earthquakes happen",
    "what a black hole is",
    "how batteries store energy",
    "how soap cleans",
    "why bread goes stale",
    "how a microwave heats food",
    "what DNA is",
    "how recycling works",
    "how glasses help people see",
    "how bees make honey",
    "what causes wind",
    "how a bicycle gear works",
]
HOBBIES = [
    "learn to cook",
    "start a small vegetable garden",
    "get into cycling",
    "learn to draw",
    "run a half marathon",
    "write a novel",
    "become better at public speaking",
    "learn photography",
    "start meditating",
    "keep a journal",
    "learn to swim as an adult",
    "get fit at home",
    "learn sign language",
    "start a book club",
    "learn to knit",
]
MORE_PAIRS = [
    ("a violin", "a viola"),
    ("tea", "coffee"),
    ("renting", "buying a home"),
    ("a novel", "a novella"),
    ("a cold", "the flu"),
    ("a comet", "an asteroid"),
    ("butter", "margarine"),
    ("a university", "a college"),
    ("an electric car", "a petrol car"),
    ("a memoir", "an autobiography"),
    ("a laptop", "a tablet"),
    ("a gym", "home workouts"),
]
MORE_KINDS = [
    "a bedtime story",
    "a short motivational speech",
    "a product description",
    "a wedding toast",
    "a riddle",
    "a short fable with a moral",
    "the opening paragraph of a mystery novel",
    "a tongue twister",
]
MORE_SUBJECTS = [
    "a bicycle that wants to fly",
    "a snowman in summer",
    "a shy volcano",
    "a library book that was never borrowed",
    "a lost key",
    "an old sailor's last voyage",
    "a kite that escaped",
    "a chess piece that refuses to move",
    "a lonely streetlight",
    "a squirrel who collects buttons",
    "the first day of spring",
    "a message in a bottle",
]


def instructions(seed: int = 0) -> list[str]:
    """The generic requests (about 4 300: the first list, then `warmup_more`'s), in a fixed shuffled order."""
    out = [f"Write a {lang} function that {task}." for lang, task in itertools.product(LANGS, CODE_TASKS)]
    out += [
        f"Write a {lang} class {name} with a few useful methods."
        for name in CODE_CLASSES
        for lang in ["Python", "Java", "JavaScript"]
    ]
    out += [f"Write an SQL query that returns {q}." for q in SQL_QUERIES]
    out += [f"How do I {how} in {lang}?" for how, lang in itertools.product(CODE_HOWTOS, LANGS[:4])]
    out += [f"Explain {c} in programming, with a short example." for c in CODE_CONCEPTS]
    out += [
        f"Give {fmt} with three {things}, with the fields {fields}."
        for fmt, (things, fields) in itertools.product(FORMATS, RECORDS)
    ]
    out += [f"Write {kind} about {subj}." for kind, subj in itertools.product(CREATIVE_KINDS, SUBJECTS)]
    out += [ask.format(goal) for ask, goal in itertools.product(ASKS, GOALS)]
    for w in WHYS:
        out += [f"Why {w}?", f"Explain to a child why {w}."]
    out += [f"What is the difference between {a} and {b}?" for a, b in PAIRS]
    out += [
        f"Give {fmt} with three {things}, with the fields {fields}."
        for fmt, (things, fields) in itertools.product(FORMATS + MORE_FORMATS, MORE_RECORDS)
    ]
    out += [
        f"Give {fmt} with three {things}, with the fields {fields}."
        for fmt, (things, fields) in itertools.product(MORE_FORMATS, RECORDS)
    ]
    out += [f"Write a short email {e}." for e in EMAILS]
    for x in LISTS:
        out += [f"List five {x} as a numbered list.", f"Give a bulleted list of {x}, one sentence each."]
    for x in EXPLAINS:
        out += [f"Explain {x}.", f"In simple words, explain {x}.", f"Explain to a child {x}."]
    for h in HOBBIES:
        out += [f"I want to {h}. Where should I start?", f"What are common mistakes when people {h}?"]
    for a, b in MORE_PAIRS:
        out += [f"What is the difference between {a} and {b}?", f"{a[0].upper() + a[1:]} or {b}? Give pros and cons."]
    out += [
        f"Write {kind} about {subj}." for kind, subj in itertools.product(MORE_KINDS + CREATIVE_KINDS, MORE_SUBJECTS)
    ]
    random.Random(seed).shuffle(out)
    more = more_instructions(LANGS, FORMATS + MORE_FORMATS)  # after the first list: files made from it grow
    random.Random(seed + 1).shuffle(more)
    return out + more


def stdlib_snippets(rng: random.Random, count: int = 160, lines: int = 15, pattern: str = "*.py") -> list[str]:
    """Up to `count` runs of `lines` lines from the standard library's own modules (top-level ones, or
    those `pattern` selects), to be continued."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        f
        for f in root.glob(pattern)
        if not {"test", "tests", "idlelib", "site-packages", "lib2to3"} & set(f.relative_to(root).parts)
    )
    out = []
    for f in rng.sample(files, min(count, len(files))):
        text = f.read_text(errors="ignore").splitlines()
        if len(text) < 40:
            continue
        start = rng.randrange(0, len(text) - 30)
        out.append("\n".join(text[start : start + lines]) + "\n")
    return out


def warmup_prompts(tokenizer, answer_tokens: int = 128, continue_tokens: int = 96) -> list[tuple[str, int]]:
    """(prompt text, new tokens) pairs: chat-formatted instructions and stdlib snippets, shuffled."""
    chat = getattr(tokenizer, "chat_template", None) is not None
    prompts = []
    for q in instructions():
        text = (
            tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
            if chat
            else q + "\n"
        )
        prompts.append((text, answer_tokens))
    rng = random.Random(1)
    prompts += [(s, continue_tokens) for s in stdlib_snippets(rng)]
    prompts += [(s, continue_tokens) for s in stdlib_snippets(random.Random(2), 200, pattern="*/*.py")]
    prompts += [(s, continue_tokens) for s in stdlib_snippets(random.Random(3), 200, pattern="*/*/*.py")]
    prompts += [(s, continue_tokens) for s in stdlib_snippets(random.Random(4), 200, pattern="*/*.py")]
    rng.shuffle(prompts)
    return prompts


def build_warmup(
    model_spec: str,
    out: str | Path,
    limit: int | None = None,
    batch: int = 16,
    progress: Callable[[str], None] = lambda _: None,
) -> dict:
    """Generate the warm-up answers with the full model (transformers, greedy) into `out`. If `out`
    exists, the prompts it already answers are kept and only the others are generated (an
    interrupted run resumes; a file made with a shorter list grows)."""
    import torch
    from transformers import AutoTokenizer

    from splitlm.model.loading import load_hf, resolve_model

    start = time.perf_counter()
    model_dir = resolve_model(model_spec)
    progress(f"loading {model_dir.name} (the full model, transformers)")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:  # left padding is masked out: any token will do
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.convert_ids_to_tokens(0)
    model = load_hf(str(model_dir))
    prompts = warmup_prompts(tokenizer)[:limit]
    out = Path(out)
    kept = read_warmup_records(out) if out.exists() else []
    answered = {r["prompt"] for r in kept}
    prompts = [p for p in prompts if p[0] not in answered]
    if kept:
        progress(f"{out}: {len(kept)} answers kept, {len(prompts)} prompts to go")
    else:
        progress(f"{len(prompts)} prompts to answer, {batch} at a time, into {out}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".part")
    tokens = 0
    with gzip.open(tmp, "wt", encoding="utf-8") as f, bar(len(prompts), "warmup", unit="prompt") as shown:
        for r in kept:
            f.write(json.dumps(r) + "\n")
        for i in range(0, len(prompts), batch):
            chunk = prompts[i : i + batch]
            enc = tokenizer([p for p, _ in chunk], return_tensors="pt", padding=True, add_special_tokens=False)
            with torch.inference_mode():
                gen = model.generate(
                    **enc, max_new_tokens=max(n for _, n in chunk), do_sample=False, pad_token_id=tokenizer.pad_token_id
                )
            for (prompt, n), row in zip(chunk, gen[:, enc.input_ids.shape[1] :].tolist(), strict=True):
                if tokenizer.eos_token_id in row:
                    row = row[: row.index(tokenizer.eos_token_id)]
                row = row[:n]
                tokens += len(row)
                f.write(json.dumps({"prompt": prompt, "text": tokenizer.decode(row, skip_special_tokens=True)}) + "\n")
            shown.update(len(chunk))  # tqdm's ETA: the remaining prompts at the measured rate
            shown.set_postfix_str(f"{tokens / (time.perf_counter() - start):.0f} tok/s")
    tmp.replace(out)
    return {
        "out": str(out),
        "prompts": len(prompts),
        "kept": len(kept),
        "tokens": tokens,
        "seconds": round(time.perf_counter() - start, 1),
    }


def read_warmup_records(path: str | Path) -> list[dict]:
    """The {"prompt", "text"} records of a warm-up file."""
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            records = [json.loads(line) for line in f if line.strip()]
        for r in records:
            if not isinstance(r["prompt"], str) or not isinstance(r["text"], str):
                raise TypeError("prompt and text must be strings")
        return records
    except (OSError, EOFError, ValueError, KeyError, TypeError) as e:
        raise SplitLMError(f"{path}: not a warm-up file ({e})") from e


def read_warmup(path: str | Path) -> list[str]:
    """The answers of a warm-up file."""
    return [r["text"] for r in read_warmup_records(path)]


def find_warmup(edge_dir: str | Path, model_hash: str | None) -> Path | None:
    """The edge shard's own warm-up file, else the bundled one for this model, else None."""
    own = Path(edge_dir) / WARMUP_FILE
    if own.is_file():
        return own
    if model_hash:
        bundled = BUNDLED_DIR / f"{model_hash}.jsonl.gz"
        if bundled.is_file():
            return bundled
    return None
