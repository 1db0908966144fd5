"""Tool-call prompts for `models/demo`, shared by the speculative-decoding tests."""

from __future__ import annotations

from pathlib import Path

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def weather_tool_prompts(
    demo_dir: Path, cities: tuple[str, ...] = ("Paris", "Tokyo", "Lagos")
) -> list[list[int]]:
    """The demo's chat template over one user turn asking for the weather in each city, with the tool offered."""
    from hearth.model.tokenizer import Tokenizer
    from hearth.server.chat_template import ChatTemplate

    tokenizer = Tokenizer.from_dir(demo_dir)
    template = ChatTemplate.from_dir(demo_dir)
    return [
        tokenizer.encode(
            template.render(
                [{"role": "user", "content": f"What's the weather in {city}?"}], tools=[WEATHER_TOOL]
            ),
            add_special_tokens=False,
        )
        for city in cities
    ]
