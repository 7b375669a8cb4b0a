"""The second list of generic warm-up requests (`splitlm.decoding.warmup.instructions` appends it).

Added when the draft head's held-out acceptance was found to grow with its training data (half the
first list's answers: 0.55 at depth 1, all of them: 0.60). Same kinds as the first list, new
subjects; nothing here comes from a benchmark prompt or a user.
"""

from __future__ import annotations

import itertools

CODE_TASKS_2 = [
    "counts the lines of a text that contain a given word", "returns the nth row of Pascal's triangle",
    "finds the longest palindrome inside a string", "removes the empty strings from a list",
    "checks whether two rectangles overlap", "converts a time from 12-hour to 24-hour format",
    "returns the indices of all occurrences of a value in a list", "computes the average word length of a sentence",
    "checks whether a list contains duplicates", "swaps the keys and values of a dictionary",
    "returns the number of days in a given month", "splits a sentence into words without punctuation",
    "generates a random string of letters and digits", "computes the perimeter of a polygon",
    "counts the number of vowels and consonants in a word", "returns the longest run of equal elements in a list",
    "checks whether a string starts with a capital letter", "computes the sum of a list without a built-in function",
    "finds the smallest missing positive integer in a list", "returns a list of the squares of the odd numbers",
    "formats a list of names as a readable sentence", "checks whether a year range contains a leap year",
    "computes the factorial of a number iteratively", "converts a decimal number to octal",
    "removes the duplicate characters of a string",
    "computes the nth power of a number by repeated squaring", "checks whether a number is a perfect square",
    "returns the common characters of two strings", "converts a list of numbers to their string representations",
    "calculates the tip for a restaurant bill", "finds the index of the smallest element of a list",
    "checks whether a word appears in a list, ignoring case", "computes simple interest",
    "rounds a number to the nearest multiple of five", "generates a list of dates for the next seven days",
    "counts how many numbers in a list are negative", "masks all but the last four digits of a card number",
    "builds a frequency table of the words in a file", "checks whether a string is a valid hexadecimal number",
    "returns the last word of a sentence", "concatenates the lines of a file into one string",
    "computes the area and circumference of a circle", "returns every second element of a list",
    "checks whether a point lies inside a circle", "finds the sum of all multiples of 3 or 5 below n",
    "converts a sentence to pig latin", "sorts a list of strings by their length",
    "returns the middle element of a list", "finds the longest line in a text file",
    "counts the number of words that start with a vowel", "reverses the digits of an integer",
    "checks whether all elements of a list are equal", "returns the minimum and maximum of a list in one pass",
    "converts a list into a comma-separated string", "computes the product of the elements of a list",
    "validates a date in the format YYYY-MM-DD", "generates the Collatz sequence of a number",
    "finds the element that appears only once in a list", "counts the digits of a number",
]
CODE_HOWTOS_2 = ["remove an item from a list", "read a JSON file", "write text to a file", "sleep for a second",
                 "get the length of a string", "loop over a range of numbers", "sort a dictionary by its values",
                 "create an empty set", "check the type of a variable", "generate a random number",
                 "reverse a string", "round a floating-point number", "copy a list", "find the index of an item",
                 "convert a list to a string", "measure elapsed time", "read user input from the console",
                 "check whether a file exists", "merge two lists", "print without a newline"]
CODE_CONCEPTS_2 = ["a pointer", "an interface", "an abstract class",
                   "a mutex", "a deadlock", "a thread pool", "lazy evaluation", "pattern matching", "type inference",
                   "a virtual machine", "a compiler", "an interpreter", "a hash collision", "an exception", "a namespace", "a module", "encapsulation", "a singleton", "an enum",
                   "a tuple", "a set", "a heap", "a graph", "dynamic programming", "a regular expression",
                   "asynchronous programming"]
RECORDS_2 = [("cars for sale", "model, mileage, price"),
             ("restaurants", "name, cuisine, rating"), ("users", "username, email, age"),
             ("products", "name, category, stock"), ("invoices", "number, date, amount"),
             ("patients", "name, age, ward"), ("buildings", "name, city, floors"),
             ("concerts", "artist, venue, date"), ("exercises", "name, muscle group, repetitions"),
             ("dinosaurs", "name, period, diet"), ("painters", "name, nationality, famous work"),
             ("shops", "name, street, opening hours"), ("vegetables", "name, colour, calories"),
             ("podcasts", "title, host, episodes"), ("airports", "code, city, terminals"),
             ("boats", "name, length, crew"), ("sports", "name, players per team, ball"), ("elements", "name, symbol, atomic number"),
             ("schools", "name, town, pupils"), ("tasks", "title, owner, due date"),
             ("sensors", "id, location, reading")]
CREATIVE_KINDS_2 = ["a short poem", "a haiku", "a short story", "a limerick", "a diary entry", "a song chorus",
                    "a fairy tale", "a short dialogue", "a bedtime story", "a short fable with a moral",
                    "a riddle", "a short speech", "a sonnet", "a news report from the future"]
SUBJECTS_2 = ["the last leaf on a tree", "a clockmaker's apprentice",
              "a storm over a quiet harbour", "a bus driver who knows every passenger", "a lost glove",
              "a boy who builds a raft", "a tortoise who wants to race", "an abandoned fairground",
              "a map that changes every day", "a grandfather's old radio", "a city without cars",
              "a goldfish who wants to see the ocean", "a snail on a long journey", "a teacher's last day",
              "a window that shows tomorrow", "a whale who sings off-key", "a farmer and a clever crow",
              "a candle in a dark room", "a river that flows uphill", "a pair of old boots",
              "a violin found in an attic", "a house made of books", "a bee who is afraid of flowers", "a sailor and a mermaid",
              "a summer afternoon at the beach", "a mouse in a museum", "a wizard who forgot his spells",
              "a bridge between two villages"]
GOALS_2 = ["wake up earlier", "learn to cook simple meals", "spend less time on my phone", "become more confident", "remember names better", "make my morning routine faster", "write more clearly", "stay focused while studying",
           "deal with a difficult coworker", "improve my posture", "learn to type faster", "start a small business",
           "keep in touch with old friends", "make a good first impression", "stop biting my nails",
           "get over a fear of flying", "pack a suitcase efficiently", "train for a 5k run", "declutter my home",
           "learn basic first aid", "memorise a speech", "save for a holiday", "cook for a large group",
           "choose a good book to read", "keep my car in good condition", "teach my dog to sit",
           "be a better listener", "eat less sugar", "make a weekly meal plan", "decorate a small apartment",
           "learn to dance", "grow tomatoes on a balcony", "stay warm in winter without high bills",
           "improve my memory", "get more done at home", "write a thank-you note", "study a new subject on my own",
           "organise my email inbox", "calm down before an exam", "make friends at a new school",
           "choose a gift for my mother", "keep a New Year's resolution", "find a new hobby", "take care of my skin", "run a meeting well"]
WHYS_2 = ["the grass is green", "we get goosebumps", "the desert is cold at night",
          "some people are left-handed", "leaves fall from trees", "we sneeze",
          "salt melts ice", "planes leave white trails", "cats land on their feet", "we have fingerprints",
          "the Earth spins", "apples turn brown when cut", "hair turns grey", "fireflies glow",
          "music gives us chills", "we get hiccups", "the sea looks blue", "dogs wag their tails",
          "clouds float", "some animals hibernate", "snowflakes have six sides",
          "our ears pop on a plane", "mirrors reverse left and right", "the wind blows", "we blush",
          "rubber bounces"]
EXPLAINS_2 = ["how a car engine works", "how the heart pumps blood", "what gravity is",
              "how a solar panel makes electricity", "how a camera takes a picture", "what a computer virus is",
              "how money is printed", "how a lock and key work", "what the immune system does",
              "how weather forecasts are made", "how a lightbulb works", "how a satellite stays in orbit",
              "what an atom is", "how rain forms", "how a touchscreen works", "how a bank works",
              "what an election is", "how a plant grows from a seed", "how sound travels",
              "how a submarine dives", "what a calendar year is", "how a thermometer works", "how bridges stay up",
              "how the stock market works", "how a password is stored safely", "how a search engine finds pages",
              "what electricity is", "how a river forms", "how glass is made", "how an elevator works",
              "what a food chain is", "how paper is made", "how a volcano forms", "how tides work",
              "how a radio works", "how a fridge magnet sticks", "how an email is sent",
              "how memory works in the brain"]
PAIRS_2 = [("a rabbit", "a hare"), ("a cafe", "a restaurant"), ("a democracy", "a republic"),
           ("a meteor", "a meteorite"), ("a city", "a town"), ("jam", "jelly"), ("a sweater", "a jumper"),
           ("a moth", "a butterfly"), ("a poem", "a song"), ("an ocean", "a sea"), ("a dolphin", "a porpoise"),
           ("a debit card", "a credit card"), ("a hill", "a mountain"), ("a lawyer", "a solicitor"),
           ("an emu", "an ostrich"), ("a bus", "a coach"), ("a wolf", "a dog"), ("a biography", "a novel"),
           ("an email", "a letter"), ("a cook", "a chef"), ("a river", "a stream"), ("hardware", "software"), ("a browser", "a search engine"), ("a website", "an app"),
           ("a noun", "a verb"), ("rain", "drizzle"), ("a map", "a globe"),
           ("a sprint", "a marathon")]
HOBBIES_2 = ["learn to play the piano", "start bird watching", "take up rock climbing",
             "learn woodworking", "start a blog", "learn to sew", "take up yoga", "learn to paint with watercolours",
             "start collecting stamps", "learn to sing", "take up fishing", "learn to skateboard",
             "start a podcast", "learn calligraphy", "take up hiking", "learn to play chess", "start pottery",
             "learn a magic trick", "learn to juggle", "start running every morning", "learn to make sushi",
             "build a model railway", "learn to surf", "start composting"]
EMAILS_2 = ["asking a teacher for an extension on an essay", "inviting friends to a picnic",
            "thanking a host for a dinner", "resigning from a job politely",
            "asking a colleague for help with a spreadsheet", "sharing the agenda for a meeting",
            "telling a team about a new office policy", "asking a doctor's office to move an appointment",
            "complaining politely about a noisy neighbour", "asking for a recommendation letter",
            "welcoming a new student to a class", "cancelling a gym membership", "asking a hotel about late check-in",
            "thanking a customer for an order", "reminding a team about a deadline", "offering help to a new neighbour",
            "asking a friend to be a reference", "proposing a new project to a manager",
            "apologising for a late reply"]
LISTS_2 = ["ways to relax after work", "snacks for a long road trip", "ways to be kind to strangers", "tips for studying at home", "ways to reduce plastic waste", "fun activities for a family weekend",
           "questions to ask before buying a used car", "ideas for a birthday gift", "tips for staying safe online",
           "ways to keep a conversation interesting", "healthy lunch ideas", "tips for learning to cook",
           "things to bring to a picnic", "reasons to keep a journal", "ways to stay active in winter", "ideas for a small garden", "ways to save time in the morning", "things every first-aid kit needs", "tips for writing a good essay",
           "habits of organised people", "ways to make new friends as an adult", "easy dinner recipes",
           "tips for working from home", "ways to cheer up a friend", "things to check before moving house"]
FACTS = ["octopuses", "honey", "the human brain", "elephants", "the Pacific Ocean", "volcanoes",
         "the Sahara desert", "bees", "the Eiffel Tower", "sharks", "chocolate", "the Great Wall of China",
         "owls", "the Amazon rainforest", "sloths", "dolphins", "trees", "the Olympic Games", "butterflies", "ice", "giraffes", "the internet", "lightning", "tomatoes", "kangaroos", "the alphabet"]
ADVICE = ["I have too much homework tonight", "my friend forgot my birthday", "I can't decide what to study",
          "my neighbour's dog barks all night",
          "I want to change careers", "I keep forgetting to drink water", "my room is always messy",
          "I am moving to a new country", "my computer is very slow", "I spend too much money on takeaway food",
          "I want to be more creative", "my team at work does not communicate well", "I am bored on weekends",
          "I am starting university next month", "I want to read more but never find the time", "I argued with my sister", "I feel tired every afternoon"]


def more_instructions(langs: list[str], formats: list[str]) -> list[str]:
    """About 1 800 more generic requests, in the first list's kinds (unshuffled); `langs` and
    `formats`: the first list's programming languages and record formats."""
    out = [f"Write a {lang} function that {task}." for lang, task in itertools.product(langs, CODE_TASKS_2)]
    out += [f"How do I {how} in {lang}?" for how, lang in itertools.product(CODE_HOWTOS_2, langs[:4])]
    out += [f"Explain {c} in programming, with a short example." for c in CODE_CONCEPTS_2]
    out += [f"Give {fmt} with three {things}, with the fields {fields}."
            for fmt, (things, fields) in itertools.product(formats, RECORDS_2)]
    out += [f"Write {kind} about {subj}." for kind, subj in itertools.product(CREATIVE_KINDS_2, SUBJECTS_2)]
    out += [ask.format(goal) for ask, goal in itertools.product(
        ["How can I {}?", "What is the best way to {}?", "Can you give me tips to {}?"], GOALS_2)]
    for w in WHYS_2:
        out += [f"Why {w}?", f"Explain to a child why {w}."]
    for x in EXPLAINS_2:
        out += [f"Explain {x}.", f"In simple words, explain {x}.", f"Explain to a child {x}."]
    for a, b in PAIRS_2:
        out += [f"What is the difference between {a} and {b}?", f"{a[0].upper() + a[1:]} or {b}? Which is better?"]
    for h in HOBBIES_2:
        out += [f"I want to {h}. Where should I start?", f"What are common mistakes when people {h}?"]
    out += [f"Write a short email {e}." for e in EMAILS_2]
    for x in LISTS_2:
        out += [f"List five {x} as a numbered list.", f"Give a bulleted list of {x}, one sentence each."]
    for x in FACTS:
        out += [f"Tell me three interesting facts about {x}.", f"What makes {x} special?"]
    for x in ADVICE:
        out += [f"{x[0].upper() + x[1:]}. What should I do?", f"{x[0].upper() + x[1:]}. Any advice?"]
    return out
