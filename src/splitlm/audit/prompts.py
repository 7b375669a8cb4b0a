"""Prompts for the metadata audit: beginnings of code and of prose for the model to continue.
Written for this audit, not taken from any benchmark; the classifier never sees their text."""

CODE = [
    "def parse_config(path):\n    with open(path) as f:\n",
    "import os\nimport sys\n\n\ndef main():\n",
    "class Matrix:\n    def __init__(self, rows, cols):\n",
    "for i in range(10):\n    if i % 3 == 0:\n",
    "def merge_sorted(a, b):\n    result = []\n    i = j = 0\n",
    "#include <stdio.h>\n\nint main(void) {\n",
    "function debounce(fn, delay) {\n  let timer;\n",
    "SELECT name, COUNT(*)\nFROM orders\n",
    "def read_csv(filename):\n    rows = []\n",
    "try:\n    value = int(text)\nexcept ValueError:\n",
    "public static int sum(int[] values) {\n",
    "def tokenize(text):\n    tokens = []\n    for word in text.split():\n",
]

PROSE = [
    "The village sat at the edge of a wide valley, and every morning",
    "When I was a child, my grandmother used to tell me",
    "The committee met on Tuesday to discuss the budget for the coming year.",
    "Rain had fallen for three days, and the river",
    "Most people underestimate how much sleep affects",
    "The museum's new exhibition explores the history of",
    "She opened the letter slowly, afraid of what",
    "In the early twentieth century, the railway transformed",
    "Good teachers know that curiosity cannot be forced;",
    "The recipe calls for fresh tomatoes, a little garlic and",
    "After the storm, the fishermen returned to the harbour",
    "Learning a second language as an adult is difficult because",
]
