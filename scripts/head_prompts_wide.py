"""The wide prompt families for the draft heads: many topics, many ways of asking.

The heads' agreement with the target was lowest on knowledge-heavy chat answers about topics the
training prompts never touched (docs/benchmarks.md, "Trained draft heads": 0.32-0.45 at the
first drafted position on such answers, 0.55-0.80 on code and arithmetic). A head that reads the
target's hidden states still has to carry what the target tends to say about a subject; this set
covers 523 subjects in 11 domains, asked in ~40 ways, plus code tasks and concepts across
languages and more kinds of word problem. Everything is written for this set; no prompt is, or
contains, or is contained in, an evaluation prompt (``bench/head_eval_prompts.py``), and no
prompt mentions an evaluation prompt's subject (``EVAL_SUBJECTS``), so the held-out figures
measure topics the head never saw.

    python scripts/distill_heads_data.py --model smollm2-135m-instruct --prompts wide --count 4000 \\
        --out .cache/heads/smollm2/data
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from head_eval_prompts import ALL as EVAL_PROMPTS  # noqa: E402

# words naming the evaluation prompts' subjects (lower case): a wide prompt with any of them is dropped
EVAL_SUBJECTS = (
    "vaccin", "sky", "japan", "pack", "pancake", "weather", "climate", "thank-you", "thank you", "neighbour",
    "neighbor", "from home", "focus", "coffee shop", "palindrome", "fibonacci", "stack", "csv", "merge",
    "sorted list", "comprehension", "duplicate", "sql", "customer", "feather", "kilogram", "rectangle", "apples",
    "pens ", "average speed", "youngest", "15 percent", "day of the week",
)  # fmt: skip

SUBJECTS = {
    "science": (
        "gravity", "magnetism", "electricity", "atoms", "molecules", "DNA", "cells", "evolution by natural selection",
        "plate tectonics", "the Big Bang", "stars", "comets", "the solar system", "Mars", "Jupiter", "the Sun",
        "eclipses", "light", "sound waves", "friction", "energy", "heat", "temperature", "pressure",
        "chemical reactions", "acids and bases", "salt", "water", "oxygen", "carbon", "nitrogen", "the ozone layer",
        "the atmosphere", "clouds", "lightning", "snowflakes", "fossils", "minerals", "crystals", "rocks", "soil",
        "erosion", "rivers", "oceans", "ocean currents", "deserts", "caves", "microscopes", "telescopes",
        "satellites", "the speed of light", "relativity", "quantum physics", "radioactivity", "nuclear energy",
        "batteries", "magnets in motors", "semiconductors", "lasers", "X-rays", "the laws of motion", "buoyancy",
        "density", "rust", "fire", "photons", "genes", "proteins", "enzymes", "viruses", "bacteria", "fungi", "algae",
        "the food chain", "ecosystems", "biodiversity", "pollination", "migration of birds", "hibernation",
    ),
    "health": (
        "sleep hygiene", "hydration", "stretching", "strength training", "walking", "posture", "back pain",
        "headaches", "the common cold", "allergies", "sunscreen", "vitamins", "protein", "fibre", "sugar", "caffeine",
        "breakfast", "mindfulness", "anxiety", "loneliness", "screen time", "eye strain", "dental care",
        "hand washing", "first aid", "blood pressure", "cholesterol", "the brain", "the lungs", "the kidneys",
        "the liver", "the skin", "bones", "muscles", "the digestive system", "memory", "habits", "motivation",
        "burnout", "yoga",
    ),
    "history": (
        "ancient Greece", "ancient Rome", "the Vikings", "the Middle Ages", "the Renaissance",
        "the Industrial Revolution", "the Silk Road", "the Ottoman Empire", "the Aztecs", "the Incas", "the Maya",
        "ancient China", "the Mongol Empire", "the printing of books", "the invention of the telephone",
        "the steam engine", "the first airplanes", "the space race", "the fall of the Berlin Wall",
        "the history of money", "the history of writing", "the history of medicine", "the history of maps",
        "the history of clocks", "the pyramids of Giza", "Stonehenge", "the Colosseum", "Machu Picchu", "the Titanic",
        "the Magna Carta", "the abolition of slavery", "women's right to vote", "the Cold War",
        "the invention of the wheel", "the history of the bicycle", "the history of chess",
        "the history of the Olympic marathon", "explorers of the Arctic", "medieval castles", "knights", "samurai",
        "pharaohs", "the Phoenicians",
    ),
    "places": (
        "Iceland", "Canada", "Brazil", "Kenya", "Egypt", "India", "Australia", "New Zealand", "Norway", "Mexico",
        "Peru", "Italy", "Spain", "Portugal", "Greece", "Morocco", "Vietnam", "Thailand", "Korea", "Mongolia",
        "the Sahara", "the Amazon river", "the Alps", "the Himalayas", "the Arctic", "Antarctica", "the Nile",
        "the Mediterranean Sea", "the Pacific Ocean", "Venice", "Paris", "London", "New York City", "Istanbul",
        "Cairo", "Sydney", "Buenos Aires", "Cape Town", "Scotland", "Ireland", "the Grand Canyon", "Yellowstone",
        "the Galapagos Islands", "Madagascar", "Hawaii", "Alaska", "Switzerland", "the Netherlands",
    ),
    "home": (
        "cleaning a kitchen", "doing laundry", "ironing shirts", "organising a wardrobe", "fixing a leaking tap",
        "hanging a picture", "saving energy at home", "composting", "growing herbs on a windowsill",
        "choosing a mattress", "moving house", "living with roommates", "cooking rice", "making soup",
        "roasting vegetables", "baking cookies", "making a salad", "grilling fish", "meal planning",
        "grocery shopping on a budget", "storing leftovers", "knife skills", "making tea",
        "making bread without yeast", "cooking pasta", "making an omelette", "spices", "herbs", "olive oil", "cheese",
        "yogurt", "beans and lentils", "potatoes", "rice", "tomatoes", "apples and pears", "bananas", "citrus fruits",
        "mushrooms", "eggs", "hosting a dinner", "setting a table", "caring for a cat", "caring for a goldfish",
        "walking a dog", "keeping a rabbit", "feeding garden birds", "a first aid kit for the home", "smoke alarms",
        "childproofing a home", "a family budget", "a weekly cleaning routine", "repairing a bicycle tyre",
        "sewing a button", "painting furniture", "building a bookshelf", "insulating a loft", "a vegetable garden",
    ),
    "technology": (
        "smartphones", "Wi-Fi", "Bluetooth", "email", "search engines", "social media", "online privacy", "passwords",
        "two-factor authentication", "phishing", "backups", "cloud storage", "operating systems", "Linux",
        "web browsers", "websites", "HTML", "CSS", "databases", "spreadsheets for budgeting",
        "artificial intelligence", "chatbots", "robots", "self-driving cars", "drones", "3D printing",
        "virtual reality", "computer viruses", "encryption", "the blockchain", "smart homes", "e-readers",
        "digital cameras", "video calls", "streaming music", "open-source licences", "programming languages",
        "compilers", "computer memory", "processors", "keyboards", "touchscreens", "fibre-optic cables",
        "data centres", "electric bicycles", "GPS", "barcodes", "radio", "television",
    ),
    "money_work": (
        "budgeting", "an emergency fund", "interest rates", "loans", "taxes", "insurance", "retirement savings",
        "index funds", "shares and bonds", "renting versus buying a home", "negotiating a salary",
        "asking for a raise", "job interviews", "writing a cover letter", "working in a team", "giving feedback",
        "receiving criticism", "time management", "remote meetings", "writing clear emails",
        "starting a small business", "freelancing", "customer service", "marketing", "pricing a product",
        "leadership", "mentoring", "changing careers", "networking", "taking notes in meetings",
        "making a presentation", "setting goals", "procrastination", "work-life balance",
        "learning new skills at work", "writing a report",
    ),
    "nature": (
        "wolves", "foxes", "bears", "elephants", "giraffes", "lions", "tigers", "whales", "dolphins", "sharks",
        "octopuses", "jellyfish", "turtles", "frogs", "snakes", "lizards", "owls", "eagles", "parrots", "crows",
        "hummingbirds", "butterflies", "ants", "spiders", "earthworms", "oak trees", "pine forests", "cacti",
        "sunflowers", "roses", "mosses", "mangroves", "wetlands", "savannas", "tundra", "coral", "kelp forests",
        "rivers in spring", "autumn leaves", "seeds", "mushrooms in the forest", "bats", "horses", "cows", "sheep",
        "goats", "camels", "kangaroos", "koalas", "pandas",
    ),
    "arts": (
        "painting with watercolours", "sculpture", "photography", "poetry", "novels", "short stories", "theatre",
        "opera", "ballet", "classical music", "rock music", "hip hop", "folk songs", "the violin", "the drums",
        "choirs", "film making", "animation", "comics", "architecture", "calligraphy", "pottery", "knitting",
        "woodworking", "museums", "street art", "Shakespeare", "fairy tales", "myths", "libraries", "board games",
        "card games", "puzzles", "crosswords", "football", "basketball", "tennis", "swimming", "cycling races",
        "skiing", "rock climbing", "hiking", "sailing", "fishing", "gymnastics", "martial arts",
    ),
    "society": (
        "voting", "elections", "laws", "courts", "human rights", "newspapers", "public transport", "cities",
        "villages", "schools", "universities", "homework", "exams", "teachers", "languages of the world",
        "learning to read", "bilingual children", "holidays around the world", "birthdays", "weddings",
        "good manners", "kindness", "honesty", "teamwork", "volunteering abroad", "charities", "recycling rules",
        "plastic pollution", "air pollution", "clean water", "food waste", "fair trade", "tourism", "traffic jams",
        "cycling lanes", "electric buses", "high-speed rail", "airports", "ports and shipping",
    ),
    "ideas": (
        "the scientific method", "critical thinking", "logic", "probability", "statistics", "averages", "fractions",
        "negative numbers", "prime numbers", "geometry", "algebra", "graphs and charts", "infinity", "zero",
        "patterns in nature", "cause and effect", "correlation", "bias", "curiosity", "creativity",
        "memory techniques", "learning styles", "practice", "failure", "ethics", "fairness", "philosophy", "Socrates",
        "happiness", "gratitude", "trust", "empathy", "debate", "persuasion", "storytelling",
    ),
}  # fmt: skip

ASKS = (
    "What is {s}? Explain briefly.",
    "Tell me about {s}.",
    "Explain {s} in simple words.",
    "Give me five facts about {s}.",
    "What should everyone know about {s}?",
    "Write a short introduction to {s} for a school newsletter.",
    "I know nothing about {s}. Where should I start?",
    "What are the most important things to understand about {s}?",
    "Explain {s} to a teenager.",
    "Write three quiz questions about {s}, with answers.",
    "What is a surprising fact about {s}?",
    "Describe {s} in one paragraph.",
    "Why is {s} important?",
    "What are some myths about {s}, and what is the truth?",
    "Write a short poem about {s}.",
    "Summarize what you know about {s} in five bullet points.",
    "How has {s} changed over time?",
    "Write a short dialogue between two friends talking about {s}.",
    "What questions do children often ask about {s}? Answer two of them.",
    "Give me a study plan for learning about {s} in two weeks.",
    "Write a short blog post titled 'Why I love {s}'.",
    "What are the main benefits and risks related to {s}?",
    "Explain {s} using an everyday analogy.",
    "What are three good books or resources about {s}, and why?",
    "What do experts disagree about when it comes to {s}?",
    "Write a short encyclopedia-style entry on {s}.",
    "If I had five minutes to learn about {s}, what would you tell me?",
    "Describe how {s} affects everyday life.",
    "Give me a fun activity for a family that involves {s}.",
    "What vocabulary should I learn to talk about {s}?",
    "Can you help me understand {s}? I find it confusing.",
    "Write a short speech about {s}.",
    "How would you explain {s} to someone from the year 1800?",
    "List the key terms related to {s} and define each in one sentence.",
    "What jobs involve {s}?",
    "Compare {s} and {u}: what do they have in common and how do they differ?",
    "Write a short story for children about {s}.",
    "What are some tips for someone interested in {s}?",
    "Write a short product description that mentions {s}.",
    "Which mistakes do beginners make with {s}?",
)

CODE_TASKS_WIDE = (
    "returns the n-th prime number",
    "counts the vowels in a string",
    "converts Roman numerals to integers",
    "converts an integer to Roman numerals",
    "checks whether brackets in a string are balanced",
    "returns the longest word in a sentence",
    "computes the power set of a list",
    "generates all permutations of a string",
    "finds the missing number in a list from 1 to n",
    "computes the dot product of two vectors",
    "multiplies two matrices",
    "returns the running total of a list",
    "converts kilometres to miles",
    "formats a number of seconds as hours, minutes and seconds",
    "parses a date string into year, month and day",
    "counts the words in a text file",
    "returns the unique characters of a string in order",
    "checks whether a list is sorted",
    "implements insertion sort",
    "implements quicksort",
    "implements bubble sort",
    "finds the longest common prefix of a list of strings",
    "compresses a string with run-length encoding",
    "decodes a run-length encoded string",
    "returns the mode of a list of numbers",
    "computes the median of a list",
    "computes a moving average",
    "generates a random password",
    "checks whether a number is a perfect square",
    "converts a hexadecimal string to an integer",
    "returns the digits of a number in reverse order",
    "implements a queue with two lists",
    "implements a simple linked list",
    "counts the words that start with a capital letter",
    "finds all pairs in a list that sum to zero",
    "returns the Collatz sequence for a number",
    "converts snake_case to camelCase",
    "truncates a string to n characters with an ellipsis",
    "shuffles a list without using a library shuffle",
    "checks whether a string is a valid IPv4 address",
    "returns the nth row of Pascal's triangle",
    "computes the least common multiple of two integers",
    "groups words by their first letter",
    "counts the number of set bits in an integer",
    "returns the k largest numbers in a list",
    "removes the whitespace at both ends of every line of a text",
    "converts a list of pairs into a dictionary",
    "inverts a dictionary",
    "returns the depth of a nested list",
    "checks whether a sentence contains every letter of the alphabet",
)

CODE_FORMS_WIDE = (
    "Write a {lang} function that {task}.",
    "Can you show me how to write a function in {lang} that {task}?",
    "I need {lang} code that {task}. Please add comments.",
    "Write a function that {task}, in {lang}, and give one example of calling it.",
    "Implement, in {lang}, a function that {task}. Explain the time complexity.",
)

LANGUAGES_WIDE = (
    "Python", "JavaScript", "TypeScript", "Go", "Rust", "Java", "C", "C++", "Ruby", "Kotlin", "Swift", "PHP", "C#",
)  # fmt: skip

CONCEPTS = (
    "variables", "functions", "loops", "recursion", "classes", "inheritance", "interfaces", "generics", "exceptions",
    "iterators", "generators", "decorators", "lambdas", "closures", "hash maps", "sets", "arrays", "linked lists",
    "trees", "graphs", "binary search", "sorting algorithms", "dynamic programming", "memoization", "big O notation",
    "unit testing", "debugging", "version control", "branches in git", "pull requests", "code review", "APIs",
    "HTTP requests", "JSON", "regular expressions", "threads", "async code", "mutexes", "immutability",
    "pure functions", "type hints", "static typing", "garbage collection", "pointers", "memory leaks",
    "environment variables", "command-line arguments", "logging", "configuration files", "dependency management",
    "virtual environments", "containers", "continuous integration", "refactoring", "design patterns",
    "the singleton pattern", "the observer pattern", "dependency injection", "caching", "pagination", "rate limiting",
    "authentication", "hashing passwords", "input validation", "file I/O", "string formatting", "enums", "tuples",
    "dictionaries in Python", "promises in JavaScript", "traits in Rust", "goroutines in Go", "slices in Go",
    "ownership in Rust", "templates in C++", "streams in Java",
)  # fmt: skip

CONCEPT_ASKS = (
    "Explain {c} in programming, with a short example.", "What are {c}, and when should I use them?",
    "What are common mistakes with {c}?", "How would you teach {c} to a new programmer?",
    "Give me an example in {lang} that shows {c}.", "What is the difference between {c} and {d}?",
)  # fmt: skip

REASONING_WIDE = (
    "A baker makes {a} rolls and puts them in bags of {c}. How many full bags are there, and how many rolls are left? Explain.",
    "A car uses {c} litres of fuel per 100 km. How much fuel does it need for {a} km? Show your steps.",
    "Anna has {a} stickers. She gives a quarter to her sister and {b} to a friend. How many does she keep? Explain.",
    "A ticket costs {b} dollars for adults and half that for children. What do {c} adults and {d} children pay in total? Work it out.",
    "A swimmer does {c} lengths of a {b}-metre pool every day for {d} days. How far does she swim? Explain.",
    "Water fills a bath at {c} litres per minute. The bath holds {a} litres. How long does it take to fill? Show the steps.",
    "A shop buys a lamp for {a} dollars and sells it for {p} percent more. What is the selling price? Explain.",
    "A clock gains {c} minutes every day. After {d} days, how far ahead is it? Explain your reasoning.",
    "Five people shake hands with each other once. How many handshakes are there? Explain.",
    "A bag has {c} red balls and {d} blue balls. What is the probability of drawing a red one? Explain.",
    "I think of a number, double it and add {b}. The result is {a}. What was my number? Show how you solve it.",
    "The sum of two numbers is {a} and their difference is {b}. What are the numbers? Explain step by step.",
    "A map uses a scale of 1 cm to {c} km. Two towns are {d} cm apart on the map. How far apart are they really?",
    "A plant grows {c} cm a week. It is {b} cm tall now. How tall will it be after {d} weeks? Explain.",
    "How many minutes are there in {c} days? Show your calculation.",
    "Two angles of a triangle measure {e}0 and {f}0 degrees. Is that possible, and if so, what is the third angle? Explain.",
    "Every student in the club plays chess. Omar does not play chess. Is Omar in the club? Explain.",
    "Every square has four sides. This shape has three sides. Can it be a square? Explain.",
    "A number is divisible by 3 and by 4. Must it be divisible by 12? Explain with examples.",
    "Sara reads {c} pages on weekdays and {d} pages on each weekend day. How many pages does she read in a week?",
    "A worker earns {b} dollars an hour and works {c} hours a day, {d} days a month. What does she earn in a month?",
    "A pizza is cut into {e} equal slices. Tom eats {g} slices and Mia eats {h}. What fraction of the pizza is left?",
    "A runner finishes {c} laps in {a} seconds. What is the average time per lap? Explain.",
    "Which is the better deal: {c} notebooks for {a} cents or {d} notebooks for {b}0 cents? Explain.",
    "There are {a} seats in a hall arranged in rows of {e}. How many rows are needed? Explain.",
)


HELD_OUT = [p for _, p in EVAL_PROMPTS]


def _allowed(prompt: str) -> bool:
    """Neither an evaluation prompt (equal, containing or contained) nor naming one's subject."""
    low = prompt.lower()
    return not any(w in low for w in EVAL_SUBJECTS) and not any(e in prompt or prompt in e for e in HELD_OUT)


def wide_prompts(count: int, seed: int = 0) -> list[tuple[str, str]]:
    """``count`` distinct (kind, prompt) pairs: about 55% chat over ``SUBJECTS`` x ``ASKS``
    (every domain alike), 25% code (tasks across ``LANGUAGES_WIDE``, concept questions), 20%
    reasoning (word problems with random numbers, logic); shuffled, reproducible, none touching
    an evaluation prompt or its subject."""
    rng = random.Random(seed + 104729)
    domains = sorted(SUBJECTS)
    n_chat, n_code = int(count * 0.55), int(count * 0.25)
    chat_room = sum(map(len, SUBJECTS.values())) * len(ASKS) // 2  # (kept well under every combination)
    if n_chat > chat_room or n_code > len(CODE_FORMS_WIDE) * len(CODE_TASKS_WIDE) * len(LANGUAGES_WIDE):
        raise ValueError(f"{count} wide prompts asked: more than the families can make")
    chat: set[str] = set()
    while len(chat) < n_chat:
        s, u = rng.sample(SUBJECTS[rng.choice(domains)], 2)
        p = rng.choice(ASKS).format(s=s, u=u)
        if _allowed(p):
            chat.add(p)
    code: set[str] = set()
    while len(code) < n_code:
        if rng.random() < 0.6:
            p = rng.choice(CODE_FORMS_WIDE).format(lang=rng.choice(LANGUAGES_WIDE), task=rng.choice(CODE_TASKS_WIDE))
        else:
            c, d = rng.sample(CONCEPTS, 2)
            p = rng.choice(CONCEPT_ASKS).format(c=c, d=d, lang=rng.choice(LANGUAGES_WIDE))
        if _allowed(p):
            code.add(p)
    reasoning: set[str] = set()
    while len(reasoning) < count - n_chat - n_code:
        a, b, c = rng.randint(20, 480), rng.randint(2, 40), rng.randint(2, 12)
        d, e, f = rng.randint(2, 15), rng.randint(3, 16), rng.randint(2, 9)
        g = rng.randint(1, e // 2)
        p = rng.choice(REASONING_WIDE).format(
            a=a, b=b, c=c, d=d, e=e, f=f, g=g, h=rng.randint(0, e - g), p=rng.choice((10, 20, 25, 30, 40, 50))
        )
        if _allowed(p):
            reasoning.add(p)
    pairs = [("chat", p) for p in sorted(chat)] + [("code", p) for p in sorted(code)]
    pairs += [("reasoning", p) for p in sorted(reasoning)]
    rng.shuffle(pairs)
    return pairs
