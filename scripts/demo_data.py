"""Training and evaluation data for Hearth's demo models.

Two sources, both available on any machine with Python and no network:

- the standard library's own source and docstrings (general text and code), split into train and
  held-out files by a hash of each file's path;
- synthetic agent conversations: a system prompt, 2-4 tool schemas picked from `TOOLS`, user requests,
  assistant tool calls, tool results and final answers, rendered with `CHAT_TEMPLATE` (the same
  template that ships in the model's tokenizer_config.json).

Everything is a pure function of a seed, so a run is reproducible on the same Python version.
"""

from __future__ import annotations

import ast
import hashlib
import json
import random
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Added as whole tokens (not "special", so decoding keeps them): the tool-call parser reads them as text.
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
# Held-out conversations and prompts come from seed + this offset, a different random stream.
HELDOUT_SEED_OFFSET = 1_000_003

# Hermes/Qwen convention. Plain jinja2 plus `tojson` (transformers' version: no HTML escaping).
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- 'You may call these tools:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    '{{- \'\\n</tools>\\nTo call one, reply with <tool_call>{"name": ..., "arguments": {...}}</tool_call>'
    "<|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{- '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set fn = call['function'] if call.get('function') else call %}"
    "{{- '<tool_call>{\"name\": \"' + fn['name'] + '\", \"arguments\": ' + "
    "(fn['arguments'] if fn['arguments'] is string else (fn['arguments'] | tojson)) + '}</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **kwargs: Any) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kwargs)


def _compile_template() -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = _tojson
    return env.from_string(CHAT_TEMPLATE)


_TEMPLATE = _compile_template()


def render_chat(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, add_generation_prompt: bool = False
) -> str:
    """Render like `tokenizer.apply_chat_template(..., tokenize=False)` does (tests pin the equality)."""
    return _TEMPLATE.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt)


# ---------------------------------------------------------------------------------------------
# Value pools for tool arguments.

# fmt: off
CITIES = [
    "Paris", "London", "Berlin", "Madrid", "Rome", "Lisbon", "Vienna", "Prague", "Warsaw", "Oslo",
    "Stockholm", "Helsinki", "Dublin", "Amsterdam", "Brussels", "Zurich", "Athens", "Istanbul", "Cairo",
    "Nairobi", "Lagos", "Tokyo", "Osaka", "Seoul", "Beijing", "Shanghai", "Singapore", "Bangkok", "Delhi",
    "Mumbai", "Sydney", "Melbourne", "Auckland", "Toronto", "Montreal", "Vancouver", "New York", "Boston",
    "Chicago", "Denver", "Seattle", "San Francisco", "Los Angeles", "Austin", "Miami", "Mexico City",
    "Lima", "Bogota", "Santiago", "Buenos Aires", "Sao Paulo", "Cape Town", "Dubai", "Reykjavik",
]
PEOPLE = [
    "Alice", "Bob", "Carol", "Dave", "Erin", "Frank", "Grace", "Heidi", "Ivan", "Judy", "Mallory", "Niaj",
    "Olivia", "Peggy", "Rupert", "Sybil", "Trent", "Victor", "Walter", "Yara", "Zoe", "Liam", "Noah",
    "Emma", "Ava", "Mia", "Lucas", "Sofia", "Mateo", "Amir", "Priya", "Chen", "Kenji", "Fatima", "Omar",
    "Ines", "Hugo", "Lena", "Marco", "Nina",
]
SURNAMES = ["Smith", "Garcia", "Chen", "Kumar", "Müller", "Rossi", "Dubois", "Tanaka", "Silva", "Novak"]
DOMAINS = ["example.com", "mail.org", "acme.io", "corp.net", "hearth.dev", "school.edu"]
SUBJECTS = [
    "Meeting notes", "Project update", "Lunch on Friday", "Invoice 2291", "Quarterly report", "Welcome",
    "Travel plans", "Code review", "Budget draft", "Happy birthday", "Server outage", "Weekly sync",
]
BODIES = [
    "See you at the meeting tomorrow.", "The report is attached.", "Can we move our call to Monday?",
    "Thanks for your help last week!", "The build is green again.", "Please review the draft by Friday.",
    "I will be out of office next week.", "Lunch is on me today.", "The server is back online.",
]
EVENT_TITLES = [
    "Team standup", "Dentist appointment", "Dinner with Sam", "Budget review", "Yoga class", "Flight to Rome",
    "Doctor visit", "Sprint planning", "Book club", "Piano lesson", "Interview", "Design review",
]
TASKS = [
    "buy milk", "call the plumber", "renew my passport", "water the plants", "finish the slides",
    "pay the electricity bill", "book a haircut", "back up the laptop", "send the invoice", "clean the garage",
    "reply to Grace", "update the README", "fix the failing test", "order printer ink",
]
QUERIES = [
    "best hiking trails near Denver", "python asyncio tutorial", "how to bake sourdough bread",
    "latest results of the world cup", "cheap flights to Japan", "how do vaccines work", "rust vs go",
    "history of the printing press", "what is a transformer model", "symptoms of the flu",
    "how to fix a flat tire", "kv cache paged attention", "healthy breakfast ideas", "jazz concerts tonight",
]
CURRENCIES = ["USD", "EUR", "GBP", "JPY", "CHF", "CAD", "AUD", "CNY", "INR", "BRL", "SEK", "MXN"]
UNIT_PAIRS = [
    ("km", "miles"), ("miles", "km"), ("kg", "pounds"), ("pounds", "kg"), ("celsius", "fahrenheit"),
    ("fahrenheit", "celsius"), ("liters", "gallons"), ("meters", "feet"), ("feet", "meters"), ("inches", "cm"),
]
TICKERS = ["AAPL", "MSFT", "GOOG", "AMZN", "NVDA", "TSLA", "META", "IBM", "ORCL", "INTC", "AMD", "NFLX"]
LANGUAGES = ["French", "German", "Spanish", "Italian", "Japanese", "Portuguese", "Dutch", "Korean", "Polish"]
PHRASES = [
    "good morning", "where is the train station", "thank you very much", "how much does this cost",
    "I would like a coffee", "the meeting is cancelled", "see you tomorrow", "I love this city",
]
FILES = [
    "notes.txt", "README.md", "src/main.py", "config.yaml", "data/users.csv", "docs/intro.md", "todo.txt",
    "app/server.py", "report.json", "logs/app.log", "setup.cfg", "tests/test_api.py",
]
DIRS = [".", "src", "docs", "data", "logs", "tests", "/tmp", "/home/user", "app", "scripts"]
SHELL_COMMANDS = [
    "ls -la", "git status", "pytest -q", "df -h", "uptime", "python --version", "du -sh .", "whoami",
    "cat /etc/hostname", "pip list", "make build", "echo hello",
]
CUISINES = ["italian", "japanese", "mexican", "indian", "thai", "french", "chinese", "greek", "vegan"]
TRAVEL_MODES = ["driving", "walking", "transit", "cycling"]
PLACES = [
    "the airport", "the central station", "the museum", "the office", "the beach", "the stadium",
    "the university", "the hospital", "the old town", "the harbor",
]
SONGS = [
    ("Bohemian Rhapsody", "Queen"), ("Imagine", "John Lennon"), ("Hey Jude", "The Beatles"),
    ("Clair de Lune", "Debussy"), ("So What", "Miles Davis"), ("Hallelujah", "Leonard Cohen"),
    ("Yesterday", "The Beatles"), ("Respect", "Aretha Franklin"), ("Heroes", "David Bowie"),
]
TIMEZONES = [
    "Europe/Paris", "Europe/London", "America/New_York", "America/Los_Angeles", "Asia/Tokyo",
    "Asia/Kolkata", "Australia/Sydney", "America/Sao_Paulo", "Africa/Nairobi", "UTC",
]
NEWS_TOPICS = ["technology", "sports", "science", "politics", "business", "health", "climate", "space"]
SQL = [
    "SELECT * FROM users LIMIT 10", "SELECT count(*) FROM orders", "SELECT name FROM products WHERE price > 100",
    "SELECT city, count(*) FROM customers GROUP BY city", "SELECT id, total FROM invoices ORDER BY total DESC",
]
DATABASES = ["sales", "analytics", "inventory", "crm", "prod"]
URLS = [
    "https://example.com", "https://api.example.com/status", "https://hearth.dev/docs",
    "https://news.example.org/today", "http://localhost:8000/health", "https://data.example.net/v1/items",
]
REPOS = ["hearth/server", "acme/web", "octo/cli", "team/infra", "lab/models", "docs/site"]
ISSUE_TITLES = [
    "Crash on empty prompt", "Add dark mode", "Timeout when streaming", "Typo in README",
    "Support Python 3.13", "Memory leak in cache", "Slow startup", "Wrong status code on error",
]
LABELS = ["bug", "enhancement", "docs", "performance", "good first issue", "urgent"]
PRODUCTS = [
    "coffee beans", "AA batteries", "a desk lamp", "running shoes", "a phone charger", "printer paper",
    "a water bottle", "noise cancelling headphones", "a yoga mat", "green tea",
]
WIKI_TITLES = [
    "Alan Turing", "Photosynthesis", "The Moon", "Python (programming language)", "Mount Everest",
    "Marie Curie", "Black holes", "The Roman Empire", "Jazz", "Plate tectonics", "Ada Lovelace",
]
WORDS = ["serendipity", "ephemeral", "ubiquitous", "latency", "throughput", "gregarious", "quixotic", "idempotent"]
ROOMS = ["living room", "kitchen", "bedroom", "office", "bathroom", "garage", "hallway"]
PACKAGES = ["numpy", "requests", "torch", "fastapi", "pydantic", "httpx", "pytest", "tokenizers", "rich"]
CONDITIONS = ["sunny", "cloudy", "rainy", "windy", "snowy", "foggy", "clear", "stormy"]
STATS = ["mean", "median", "max", "min", "sum"]
# fmt: on


def _date(rng: random.Random) -> str:
    return f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"


def _time(rng: random.Random) -> str:
    return f"{rng.randint(6, 21):02d}:{rng.choice(['00', '15', '30', '45'])}"


def _email(rng: random.Random) -> str:
    return f"{rng.choice(PEOPLE).lower()}@{rng.choice(DOMAINS)}"


def _amount(rng: random.Random) -> float | int:
    return rng.choice([rng.randint(1, 500), round(rng.uniform(1, 300), 2)])


def _pick(pool: list[Any]) -> Callable[[random.Random], Any]:
    return lambda rng: rng.choice(pool)


def _int(low: int, high: int) -> Callable[[random.Random], int]:
    return lambda rng: rng.randint(low, high)


def _sample(pool: list[Any], low: int, high: int) -> Callable[[random.Random], list[Any]]:
    return lambda rng: rng.sample(pool, rng.randint(low, high))


# ---------------------------------------------------------------------------------------------
# The tool catalogue.


@dataclass(frozen=True)
class Param:
    name: str
    type: str  # JSON-schema type: string, integer, number, boolean, array
    description: str
    gen: Callable[[random.Random], Any]
    required: bool = True
    enum: list[str] | None = None
    item_type: str | None = None  # for arrays

    def schema(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type, "description": self.description}
        if self.enum:
            out["enum"] = self.enum
        if self.item_type:
            out["items"] = {"type": self.item_type}
        return out


@dataclass(frozen=True)
class Tool:
    """One tool: its schema, how users ask for it, what it returns and how the assistant reports it.

    Each request template names the parameters it fills as `{param}` slots; the call's arguments are
    exactly those slots, so every template must name every required parameter.
    """

    name: str
    description: str
    params: list[Param]
    requests: list[str]
    result: Callable[[dict[str, Any], random.Random], dict[str, Any]]
    answers: list[str] = field(default_factory=list)

    def schema(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": {
                    "type": "object",
                    "properties": {p.name: p.schema() for p in self.params},
                    "required": [p.name for p in self.params if p.required],
                },
            },
        }


def _r(**fixed: Any) -> Callable[[dict[str, Any], random.Random], dict[str, Any]]:
    """A result builder: values are constants or callables of the rng."""

    def build(args: dict[str, Any], rng: random.Random) -> dict[str, Any]:
        return {k: (v(rng) if callable(v) else v) for k, v in fixed.items()}

    return build


# fmt: off
TOOLS: list[Tool] = [
    Tool(
        "get_weather",
        "Get the current weather in a city.",
        [
            Param("city", "string", "City name", _pick(CITIES)),
            Param("unit", "string", "Temperature unit", _pick(["celsius", "fahrenheit"]), False,
                  ["celsius", "fahrenheit"]),
        ],
        ["What's the weather in {city}?", "How warm is it in {city} right now?", "Is it raining in {city}?",
         "Weather in {city} in {unit}, please.", "Tell me the temperature in {city} in {unit}.",
         "Do I need an umbrella in {city} today?"],
        _r(temperature=_int(-10, 35), condition=_pick(CONDITIONS)),
        ["It is {temperature} degrees and {condition} in {city}.", "{city}: {condition}, {temperature} degrees."],
    ),
    Tool(
        "get_forecast",
        "Get the weather forecast for the next days.",
        [Param("city", "string", "City name", _pick(CITIES)),
         Param("days", "integer", "Number of days, 1 to 7", _int(1, 7))],
        ["What's the forecast for {city} for the next {days} days?", "Give me a {days}-day forecast for {city}.",
         "Will it be sunny in {city} over the next {days} days?"],
        _r(summary=_pick(CONDITIONS), high=_int(5, 35), low=_int(-10, 15)),
        ["The next {days} days in {city} look mostly {summary}, between {low} and {high} degrees."],
    ),
    Tool(
        "search_web",
        "Search the web and return the top results.",
        [Param("query", "string", "Search query", _pick(QUERIES)),
         Param("max_results", "integer", "How many results to return", _int(1, 10), False)],
        ["Search the web for {query}.", "Look up {query} online.", "Find me the top {max_results} results for {query}.",
         "Can you google {query}?", "I want to know about {query}. Search for it."],
        _r(top_result=_pick(["a detailed guide", "a forum thread", "a news article", "an encyclopedia entry"]),
           count=_int(3, 10)),
        ["I found {count} results; the top one is {top_result} about {query}."],
    ),
    Tool(
        "send_email",
        "Send an email.",
        [Param("to", "string", "Recipient email address", _email),
         Param("subject", "string", "Subject line", _pick(SUBJECTS)),
         Param("body", "string", "Message body", _pick(BODIES))],
        ["Send an email to {to} with subject \"{subject}\" saying: {body}",
         "Email {to}: subject {subject}, body: {body}",
         "Please write to {to}. Subject: {subject}. Text: {body}"],
        _r(status="sent", message_id=_int(1000, 9999)),
        ["Done, the email \"{subject}\" was sent to {to}.", "Your email to {to} has been sent."],
    ),
    Tool(
        "create_calendar_event",
        "Create an event in the user's calendar.",
        [Param("title", "string", "Event title", _pick(EVENT_TITLES)),
         Param("date", "string", "Date as YYYY-MM-DD", _date),
         Param("time", "string", "Start time as HH:MM", _time, False),
         Param("duration_minutes", "integer", "Length in minutes", _pick([15, 30, 45, 60, 90, 120]), False)],
        ["Add {title} to my calendar on {date}.", "Schedule {title} on {date} at {time}.",
         "Put {title} in my calendar for {date} at {time}, {duration_minutes} minutes long.",
         "Create an event called {title} on {date}."],
        _r(event_id=_int(100, 999), status="created"),
        ["{title} is now in your calendar on {date}.", "Added {title} on {date}."],
    ),
    Tool(
        "list_calendar_events",
        "List the events on a given day.",
        [Param("date", "string", "Date as YYYY-MM-DD", _date)],
        ["What's on my calendar on {date}?", "Do I have any meetings on {date}?", "Show my schedule for {date}."],
        _r(events=_sample(EVENT_TITLES, 0, 3)),
        ["Here is what you have on {date}: {events}."],
    ),
    Tool(
        "set_timer",
        "Start a countdown timer.",
        [Param("minutes", "integer", "Duration in minutes", _int(1, 90)),
         Param("label", "string", "Optional label", _pick(["pasta", "tea", "laundry", "break", "oven"]), False)],
        ["Set a timer for {minutes} minutes.", "Start a {minutes} minute timer for the {label}.",
         "Timer, {minutes} minutes please.", "Remind me in {minutes} minutes with a timer called {label}."],
        _r(status="running"),
        ["Your {minutes} minute timer is running.", "Timer set for {minutes} minutes."],
    ),
    Tool(
        "set_reminder",
        "Set a reminder at a time.",
        [Param("text", "string", "What to remind about", _pick(TASKS)),
         Param("time", "string", "Time as HH:MM", _time),
         Param("date", "string", "Date as YYYY-MM-DD", _date, False)],
        ["Remind me to {text} at {time}.", "Set a reminder to {text} on {date} at {time}.",
         "At {time}, remind me to {text}."],
        _r(status="scheduled", reminder_id=_int(1, 500)),
        ["I will remind you to {text} at {time}.", "Reminder set: {text} at {time}."],
    ),
    Tool(
        "convert_currency",
        "Convert an amount between currencies.",
        [Param("amount", "number", "Amount to convert", _amount),
         Param("from_currency", "string", "ISO currency code", _pick(CURRENCIES)),
         Param("to_currency", "string", "ISO currency code", _pick(CURRENCIES))],
        ["Convert {amount} {from_currency} to {to_currency}.", "How much is {amount} {from_currency} in {to_currency}?",
         "What are {amount} {from_currency} worth in {to_currency}?"],
        _r(converted=lambda rng: round(rng.uniform(1, 900), 2)),
        ["{amount} {from_currency} is about {converted} {to_currency}."],
    ),
    Tool(
        "convert_units",
        "Convert a value between units.",
        [Param("value", "number", "Value to convert", _amount),
         Param("from_unit", "string", "Source unit", _pick([a for a, _ in UNIT_PAIRS])),
         Param("to_unit", "string", "Target unit", _pick([b for _, b in UNIT_PAIRS]))],
        ["Convert {value} {from_unit} to {to_unit}.", "How many {to_unit} is {value} {from_unit}?",
         "{value} {from_unit} in {to_unit}?"],
        _r(result=lambda rng: round(rng.uniform(0.5, 900), 2)),
        ["{value} {from_unit} is {result} {to_unit}."],
    ),
    Tool(
        "get_stock_price",
        "Get the latest price of a stock.",
        [Param("symbol", "string", "Ticker symbol", _pick(TICKERS))],
        ["What's the price of {symbol}?", "How is {symbol} trading today?", "Get me a quote for {symbol}.",
         "Check the {symbol} stock price."],
        _r(price=lambda rng: round(rng.uniform(10, 900), 2), change_percent=lambda rng: round(rng.uniform(-5, 5), 1)),
        ["{symbol} is at {price}, {change_percent}% today."],
    ),
    Tool(
        "translate_text",
        "Translate text into another language.",
        [Param("text", "string", "Text to translate", _pick(PHRASES)),
         Param("target_language", "string", "Language to translate into", _pick(LANGUAGES))],
        ["Translate \"{text}\" into {target_language}.", "How do you say \"{text}\" in {target_language}?",
         "Can you put \"{text}\" in {target_language}?"],
        _r(translation=_pick(["(translated text)", "(traduction)", "(Übersetzung)", "(traducción)"])),
        ["In {target_language}, \"{text}\" is {translation}."],
    ),
    Tool(
        "calculate",
        "Evaluate an arithmetic expression.",
        [Param("expression", "string", "Arithmetic expression",
               lambda rng: f"{rng.randint(2, 999)} {rng.choice('+-*/')} {rng.randint(2, 99)}")],
        ["What is {expression}?", "Calculate {expression}.", "Compute {expression} for me.", "Quick math: {expression}"],
        _r(value=lambda rng: rng.randint(-500, 90000)),
        ["{expression} = {value}.", "The answer is {value}."],
    ),
    Tool(
        "read_file",
        "Read a text file from the workspace.",
        [Param("path", "string", "File path", _pick(FILES))],
        ["Show me the contents of {path}.", "Open {path}.", "What's in {path}?", "Read the file {path}."],
        _r(content=_pick(["hello world", "TODO: write docs", "name,email", "{\"debug\": true}", "import os"]),
           size_bytes=_int(10, 9000)),
        ["{path} contains: {content}", "Here is {path} ({size_bytes} bytes): {content}"],
    ),
    Tool(
        "write_file",
        "Write text to a file in the workspace.",
        [Param("path", "string", "File path", _pick(FILES)),
         Param("content", "string", "Text to write", _pick(BODIES))],
        ["Write \"{content}\" to {path}.", "Save the text \"{content}\" in {path}.", "Create {path} with: {content}"],
        _r(status="written", size_bytes=_int(10, 400)),
        ["Saved {size_bytes} bytes to {path}."],
    ),
    Tool(
        "list_directory",
        "List the files in a directory.",
        [Param("path", "string", "Directory path", _pick(DIRS)),
         Param("include_hidden", "boolean", "Also list hidden files", lambda rng: rng.random() < 0.5, False)],
        ["List the files in {path}.", "What's in the {path} folder?", "ls {path}",
         "Show the files in {path}, include_hidden={include_hidden}."],
        _r(files=_sample(FILES, 1, 4)),
        ["{path} has: {files}."],
    ),
    Tool(
        "run_shell_command",
        "Run a shell command and return its output.",
        [Param("command", "string", "Command line", _pick(SHELL_COMMANDS)),
         Param("timeout_s", "integer", "Time limit in seconds", _pick([5, 10, 30, 60]), False)],
        ["Run `{command}`.", "Execute {command} in the shell.", "Please run {command} with a {timeout_s} second timeout.",
         "What does `{command}` print?"],
        _r(exit_code=_pick([0, 0, 0, 1]), stdout=_pick(["ok", "3 passed", "main.py", "Python 3.11", "42G free"])),
        ["`{command}` exited with {exit_code} and printed: {stdout}"],
    ),
    Tool(
        "search_flights",
        "Search flights between two cities on a date.",
        [Param("origin", "string", "Departure city", _pick(CITIES)),
         Param("destination", "string", "Arrival city", _pick(CITIES)),
         Param("date", "string", "Date as YYYY-MM-DD", _date),
         Param("passengers", "integer", "Number of passengers", _int(1, 6), False)],
        ["Find flights from {origin} to {destination} on {date}.",
         "I need to fly from {origin} to {destination} on {date} with {passengers} people.",
         "Any flights {origin} to {destination} on {date}?"],
        _r(cheapest_price=_int(49, 1500), airline=_pick(["SkyJet", "AirNova", "BlueWing", "Polar Air"])),
        ["The cheapest flight from {origin} to {destination} on {date} is {cheapest_price} with {airline}."],
    ),
    Tool(
        "book_hotel",
        "Book a hotel room.",
        [Param("city", "string", "City", _pick(CITIES)),
         Param("check_in", "string", "Check-in date as YYYY-MM-DD", _date),
         Param("nights", "integer", "Number of nights", _int(1, 14)),
         Param("guests", "integer", "Number of guests", _int(1, 4), False)],
        ["Book a hotel in {city} from {check_in} for {nights} nights.",
         "I need a room in {city} for {guests} guests, {nights} nights from {check_in}.",
         "Reserve a hotel in {city}, check in {check_in}, {nights} nights."],
        _r(hotel=_pick(["Hotel Central", "The Grand", "Riverside Inn", "City Lodge"]), confirmation=_int(10000, 99999)),
        ["Booked {hotel} in {city} for {nights} nights, confirmation {confirmation}."],
    ),
    Tool(
        "find_restaurants",
        "Find restaurants by city and cuisine.",
        [Param("city", "string", "City", _pick(CITIES)),
         Param("cuisine", "string", "Type of food", _pick(CUISINES)),
         Param("max_price", "integer", "Price level 1 to 4", _int(1, 4), False)],
        ["Find a {cuisine} restaurant in {city}.", "Where can I eat {cuisine} food in {city}?",
         "Any cheap {cuisine} places in {city} up to price level {max_price}?"],
        _r(name=_pick(["Luigi's", "Sakura", "El Sol", "Taj", "Bangkok Garden", "Le Petit", "Green Leaf"]),
           rating=lambda rng: round(rng.uniform(3, 5), 1)),
        ["Try {name} in {city}, rated {rating}."],
    ),
    Tool(
        "get_directions",
        "Get directions between two places.",
        [Param("origin", "string", "Start", _pick(PLACES)),
         Param("destination", "string", "End", _pick(PLACES)),
         Param("mode", "string", "Travel mode", _pick(TRAVEL_MODES), False, TRAVEL_MODES)],
        ["How do I get from {origin} to {destination}?", "Directions from {origin} to {destination} by {mode}.",
         "Route me from {origin} to {destination}, {mode}."],
        _r(duration_minutes=_int(4, 90), distance_km=lambda rng: round(rng.uniform(0.5, 40), 1)),
        ["It takes about {duration_minutes} minutes ({distance_km} km) from {origin} to {destination}."],
    ),
    Tool(
        "play_song",
        "Play a song.",
        [Param("title", "string", "Song title", lambda rng: rng.choice(SONGS)[0]),
         Param("artist", "string", "Artist", lambda rng: rng.choice(SONGS)[1], False)],
        ["Play {title}.", "Play {title} by {artist}.", "Put on {title} by {artist}, please.", "I want to hear {title}."],
        _r(status="playing"),
        ["Now playing {title}.", "Playing {title}."],
    ),
    Tool(
        "add_todo",
        "Add an item to the to-do list.",
        [Param("task", "string", "What to do", _pick(TASKS)),
         Param("priority", "string", "Priority", _pick(["low", "medium", "high"]), False, ["low", "medium", "high"])],
        ["Add \"{task}\" to my to-do list.", "Put {task} on my list with {priority} priority.", "New to-do: {task}.",
         "I must {task}, add it as {priority} priority."],
        _r(todo_id=_int(1, 300), status="added"),
        ["Added \"{task}\" to your list.", "\"{task}\" is on your to-do list."],
    ),
    Tool(
        "list_todos",
        "List to-do items.",
        [Param("status", "string", "Which items", _pick(["open", "done", "all"]), False, ["open", "done", "all"])],
        ["What's on my to-do list?", "Show my {status} to-dos.", "List all my tasks that are {status}.",
         "What do I still have to do?"],
        _r(items=_sample(TASKS, 0, 3)),
        ["Your list: {items}."],
    ),
    Tool(
        "send_message",
        "Send a chat message to a contact.",
        [Param("contact", "string", "Contact name", _pick(PEOPLE)),
         Param("text", "string", "Message text", _pick(BODIES))],
        ["Message {contact}: {text}", "Tell {contact} \"{text}\"", "Send {contact} a message saying {text}",
         "Text {contact} that {text}"],
        _r(status="delivered"),
        ["Your message to {contact} was delivered.", "Sent to {contact}."],
    ),
    Tool(
        "lookup_contact",
        "Look up a contact's phone and email.",
        [Param("name", "string", "Contact name", _pick(PEOPLE))],
        ["What's {name}'s phone number?", "Find the contact details for {name}.", "How can I reach {name}?"],
        _r(phone=lambda rng: f"+1 555 {rng.randint(1000, 9999)}", email=_email),
        ["{name}: {phone}, {email}."],
    ),
    Tool(
        "get_time",
        "Get the current time in a time zone.",
        [Param("timezone", "string", "IANA time zone", _pick(TIMEZONES))],
        ["What time is it in {timezone}?", "Current time in {timezone}?", "Tell me the local time for {timezone}."],
        _r(time=_time),
        ["It is {time} in {timezone}."],
    ),
    Tool(
        "get_news",
        "Get the latest headlines on a topic.",
        [Param("topic", "string", "News topic", _pick(NEWS_TOPICS)),
         Param("limit", "integer", "Number of headlines", _int(1, 10), False)],
        ["What's new in {topic}?", "Give me the top {limit} {topic} headlines.", "Any {topic} news today?"],
        _r(headline=_pick(["Record set", "New study published", "Markets rally", "Launch succeeds", "Talks resume"])),
        ["Top {topic} story: {headline}."],
    ),
    Tool(
        "query_database",
        "Run a read-only SQL query.",
        [Param("sql", "string", "SQL query", _pick(SQL)),
         Param("database", "string", "Database name", _pick(DATABASES), False)],
        ["Run this query: {sql}", "Query the {database} database: {sql}", "Execute SQL `{sql}` on {database}."],
        _r(row_count=_int(0, 50)),
        ["The query returned {row_count} rows."],
    ),
    Tool(
        "http_get",
        "Fetch a URL with an HTTP GET request.",
        [Param("url", "string", "URL", _pick(URLS))],
        ["Fetch {url}.", "What does {url} return?", "GET {url}", "Check if {url} is up."],
        _r(status_code=_pick([200, 200, 404, 500]), body=_pick(["ok", "{\"status\": \"up\"}", "<html>"])),
        ["{url} answered {status_code}: {body}"],
    ),
    Tool(
        "create_issue",
        "Open an issue in a code repository.",
        [Param("repo", "string", "Repository as owner/name", _pick(REPOS)),
         Param("title", "string", "Issue title", _pick(ISSUE_TITLES)),
         Param("labels", "array", "Labels", _sample(LABELS, 1, 2), False, item_type="string")],
        ["Open an issue in {repo} titled \"{title}\".", "File a bug on {repo}: {title}.",
         "Create an issue in {repo} called \"{title}\" with labels {labels}."],
        _r(issue_number=_int(1, 4000)),
        ["Opened issue #{issue_number} in {repo}."],
    ),
    Tool(
        "order_product",
        "Order a product from the shop.",
        [Param("product", "string", "Product name", _pick(PRODUCTS)),
         Param("quantity", "integer", "How many", _int(1, 10))],
        ["Order {quantity} of {product}.", "Buy {product}, quantity {quantity}.", "I need {quantity} x {product}."],
        _r(order_id=lambda rng: f"A{rng.randint(10000, 99999)}", total=lambda rng: round(rng.uniform(3, 300), 2)),
        ["Ordered {quantity} x {product}, order {order_id}, total {total}."],
    ),
    Tool(
        "check_order_status",
        "Check the status of an order.",
        [Param("order_id", "string", "Order id", lambda rng: f"A{rng.randint(10000, 99999)}")],
        ["Where is my order {order_id}?", "Check order {order_id}.", "Has {order_id} shipped yet?"],
        _r(status=_pick(["processing", "shipped", "delivered", "delayed"])),
        ["Order {order_id} is {status}."],
    ),
    Tool(
        "get_wikipedia_summary",
        "Get a short encyclopedia summary.",
        [Param("title", "string", "Article title", _pick(WIKI_TITLES))],
        ["Tell me about {title}.", "Who or what is {title}?", "Summarize the article on {title}.",
         "Give me a short summary of {title}."],
        _r(summary=_pick(["a well known subject", "an important topic in history", "a topic in science"])),
        ["{title} is {summary}."],
    ),
    Tool(
        "set_thermostat",
        "Set the thermostat temperature.",
        [Param("temperature", "number", "Target temperature in celsius", lambda rng: rng.choice([18, 19.5, 20, 21, 22.5, 23])),
         Param("room", "string", "Room", _pick(ROOMS), False)],
        ["Set the heating to {temperature} degrees.", "Make the {room} {temperature} degrees.",
         "Thermostat to {temperature} in the {room}, please."],
        _r(status="ok"),
        ["The thermostat is set to {temperature} degrees."],
    ),
    Tool(
        "set_lights",
        "Turn lights on or off in a room.",
        [Param("room", "string", "Room", _pick(ROOMS)),
         Param("on", "boolean", "True to switch on", lambda rng: rng.random() < 0.5),
         Param("brightness", "integer", "Brightness 0 to 100", _int(0, 100), False)],
        ["Lights in the {room}: on={on}.", "Set the {room} lights on={on} at {brightness}% brightness.",
         "Switch the {room} lights, on={on}."],
        _r(status="ok"),
        ["The {room} lights are updated."],
    ),
    Tool(
        "compute_statistics",
        "Compute a statistic over a list of numbers.",
        [Param("numbers", "array", "The numbers", lambda rng: [rng.randint(0, 99) for _ in range(rng.randint(2, 6))],
               item_type="number"),
         Param("metric", "string", "Which statistic", _pick(STATS), True, STATS)],
        ["What is the {metric} of {numbers}?", "Compute the {metric} of these numbers: {numbers}.",
         "Give me the {metric} for {numbers}."],
        _r(value=lambda rng: round(rng.uniform(0, 99), 2)),
        ["The {metric} is {value}."],
    ),
    Tool(
        "define_word",
        "Look up the definition of a word.",
        [Param("word", "string", "The word", _pick(WORDS))],
        ["What does {word} mean?", "Define {word}.", "Meaning of the word {word}?"],
        _r(definition=_pick(["a noun", "an adjective", "a term from computing", "a rare word"])),
        ["\"{word}\" is {definition}."],
    ),
    Tool(
        "schedule_meeting",
        "Schedule a meeting with several people.",
        [Param("attendees", "array", "Names of the attendees", _sample(PEOPLE, 2, 4), item_type="string"),
         Param("date", "string", "Date as YYYY-MM-DD", _date),
         Param("time", "string", "Time as HH:MM", _time)],
        ["Set up a meeting with {attendees} on {date} at {time}.", "Schedule a call with {attendees} on {date}, {time}.",
         "Book time with {attendees} at {time} on {date}."],
        _r(meeting_id=_int(100, 999), status="invited"),
        ["Invited {attendees} for {date} at {time}."],
    ),
    Tool(
        "get_package_info",
        "Get the latest version of a Python package.",
        [Param("name", "string", "Package name", _pick(PACKAGES))],
        ["What's the latest version of {name}?", "Which version is {name} at?", "Look up the package {name}."],
        _r(version=lambda rng: f"{rng.randint(0, 3)}.{rng.randint(0, 30)}.{rng.randint(0, 9)}"),
        ["The latest {name} is {version}."],
    ),
]
# fmt: on
TOOLS_BY_NAME = {tool.name: tool for tool in TOOLS}

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are Hearth, an assistant that uses tools to get things done.",
    "You are an agent. Use the tools when they help answer the user.",
    "You are a concise assistant. Prefer calling a tool over guessing.",
    "You help the user with everyday tasks. Be brief.",
    "You are a coding and productivity assistant.",
    "You are a travel and scheduling assistant.",
    "Answer briefly. Call tools when needed.",
]
PREFIXES = [
    "",
    "",
    "",
    "Hi! ",
    "Hey, ",
    "Hello. ",
    "Quick question: ",
    "Could you help? ",
    "Please: ",
    "Ok. ",
]
SUFFIXES = ["", "", "", " Thanks!", " Thank you.", " Please.", " Asap.", " Cheers."]
SMALL_TALK = [
    ("Hi!", "Hello! How can I help you today?"),
    ("Hello", "Hi there! What can I do for you?"),
    ("Thanks, that's all.", "You're welcome! Have a great day."),
    ("Who are you?", "I am an assistant that can use tools to help you."),
    ("How are you?", "I'm doing well, thanks! What do you need?"),
    ("Good night", "Good night!"),
    ("Tell me a joke.", "Why do programmers prefer dark mode? Because light attracts bugs."),
    ("What is 2 plus 2?", "2 plus 2 is 4."),
]


def _text(value: Any) -> str:
    """How a slot value appears in the user's words."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        parts = [_text(v) for v in value]
        return ", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else parts[0]
    return str(value)


def _slots(template: str) -> list[str]:
    import string

    return [name for _, name, _, _ in string.Formatter().parse(template) if name]


@dataclass
class ToolRequest:
    tool: Tool
    request_text: str
    arguments: dict[str, Any]


def _make_request(tool: Tool, rng: random.Random) -> ToolRequest:
    template = rng.choice(tool.requests)
    slots = set(_slots(template))
    # Schema order, not sentence order, so the model learns one canonical argument order per tool.
    arguments = {p.name: p.gen(rng) for p in tool.params if p.name in slots}
    if tool.name == "search_flights" and arguments["origin"] == arguments["destination"]:
        arguments["destination"] = rng.choice([c for c in CITIES if c != arguments["origin"]])
    text = template.format(**{k: _text(v) for k, v in arguments.items()})
    return ToolRequest(tool, text, arguments)


def _answer(request: ToolRequest, result: dict[str, Any], rng: random.Random) -> str:
    values = {k: _text(v) if v != [] else "nothing" for k, v in {**request.arguments, **result}.items()}
    template = rng.choice(request.tool.answers)
    for name in _slots(template):  # an optional argument the user did not give
        values.setdefault(name, "the default")
    return template.format(**values)


def _decorate(text: str, rng: random.Random) -> str:
    prefix = rng.choice(PREFIXES)
    if prefix and rng.random() < 0.5:
        text = text[0].lower() + text[1:]
    return prefix + text + rng.choice(SUFFIXES)


def _call_message(requests: list[ToolRequest]) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"type": "function", "function": {"name": r.tool.name, "arguments": r.arguments}}
            for r in requests
        ],
    }


def _tool_turns(requests: list[ToolRequest], rng: random.Random) -> tuple[list[dict[str, Any]], str]:
    turns, answers = [], []
    for request in requests:
        result = request.tool.result(request.arguments, rng)
        turns.append({"role": "tool", "content": json.dumps(result, ensure_ascii=False)})
        answers.append(_answer(request, result, rng))
    return turns, " ".join(answers)


@dataclass
class Conversation:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    # Indices of assistant messages that must be tool calls (the eval's prompts end right before them).
    call_indices: list[int] = field(default_factory=list)


def _request_turn(offered: list[Tool], rng: random.Random) -> tuple[list[ToolRequest], str]:
    """One user turn: a single request (85%) or two requests the assistant answers with parallel calls."""
    if len(offered) >= 2 and rng.random() < 0.15:
        first, second = (_make_request(t, rng) for t in rng.sample(offered, 2))
        joiner = rng.choice([" Also, ", " And ", " Then ", " After that, "])
        text = first.request_text + joiner + second.request_text[0].lower() + second.request_text[1:]
        return [first, second], _decorate(text, rng)
    request = _make_request(rng.choice(offered), rng)
    return [request], _decorate(request.request_text, rng)


UNAVAILABLE_REPLIES = [
    "I can't do that: the only tools I have here are {names}.",
    "Sorry, none of my tools can do that. I can use {names}.",
    "That is not something my tools cover; I have {names}.",
]


UNAVAILABLE_SHARE = 0.12  # request turns preceded by a request for a tool that is not offered


def _unavailable_turn(offered: list[Tool], rng: random.Random) -> tuple[str, str] | None:
    """A request for a tool that is not offered, answered in words that name the offered tools.

    Without such turns the user's wording alone picks the tool, so a small model learns to ignore the
    offered list and calls tools that are not there.
    """
    others = [t for t in TOOLS if t not in offered]
    if not others:
        return None
    request = _make_request(rng.choice(others), rng)
    names = [t.name for t in offered]
    names = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
    return _decorate(request.request_text, rng), rng.choice(UNAVAILABLE_REPLIES).format(names=names)


def make_conversation(rng: random.Random) -> Conversation:
    """One synthetic agent conversation, drawn from `rng`.

    Most conversations hold several request turns over one set of offered tools, so the (costly) tool
    schemas in the system turn are paid once for several tool calls.
    """
    kind = rng.choices(["tools", "small_talk", "no_tools"], [88, 7, 5])[0]
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.85:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    if kind == "no_tools":
        user, reply = rng.choice(SMALL_TALK)
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        return Conversation(messages, None)

    offered = rng.sample(TOOLS, rng.choices([1, 2, 3, 4], [15, 35, 35, 15])[0])
    tools = [t.schema() for t in offered]
    if kind == "small_talk":
        user, reply = rng.choice(SMALL_TALK)
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        return Conversation(messages, tools)

    call_indices = []
    for _ in range(rng.choices([1, 2, 3, 4], [55, 25, 13, 7])[0]):
        unavailable = _unavailable_turn(offered, rng) if rng.random() < UNAVAILABLE_SHARE else None
        if unavailable:
            messages += [
                {"role": "user", "content": unavailable[0]},
                {"role": "assistant", "content": unavailable[1]},
            ]
        requests, user_text = _request_turn(offered, rng)
        messages.append({"role": "user", "content": user_text})
        call_indices.append(len(messages))
        messages.append(_call_message(requests))
        turns, answer = _tool_turns(requests, rng)
        messages += turns
        messages.append({"role": "assistant", "content": answer})
        if rng.random() < 0.1:
            user, reply = rng.choice(SMALL_TALK)
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    return Conversation(messages, tools, call_indices)


def conversations(seed: int, count: int) -> list[Conversation]:
    rng = random.Random(seed)
    return [make_conversation(rng) for _ in range(count)]


def render_conversation(conv: Conversation) -> str:
    return render_chat(conv.messages, conv.tools)


# ---------------------------------------------------------------------------------------------
# Standard-library text.

_SKIP_PARTS = {
    "test",
    "tests",
    "idlelib",
    "site-packages",
    "turtledemo",
    "ensurepip",
    "__pycache__",
    "lib2to3",
}


def stdlib_files(split: str, stdlib_dir: str | None = None) -> list[Path]:
    """The stdlib's .py files for `split` ("train" or "heldout"), 1 in 20 files held out by path hash."""
    root = Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if _SKIP_PARTS.intersection(rel.parts):
            continue
        held_out = int(hashlib.sha1(str(rel).encode()).hexdigest(), 16) % 20 == 0
        if held_out == (split == "heldout"):
            files.append(path)
    return files


def _docstrings(source: str) -> list[str]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc and len(doc) > 40:
                out.append(doc)
    return out


def stdlib_documents(split: str, max_chars: int, seed: int, chunk_chars: int = 1500) -> Iterator[str]:
    """Chunks of stdlib source and docstring prose, in a seeded order, up to `max_chars` in total."""
    files = stdlib_files(split)
    random.Random(seed).shuffle(files)
    total_chars = 0
    for path in files:
        try:
            source = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        pieces = ["\n\n".join(_docstrings(source))]
        pieces += [
            source[i : i + chunk_chars] for i in range(0, min(len(source), 4 * chunk_chars), chunk_chars)
        ]
        for piece in pieces:
            piece = piece.strip()
            if len(piece) < 200:
                continue
            piece = piece[: 2 * chunk_chars]
            yield piece
            total_chars += len(piece)
            if total_chars >= max_chars:
                return
