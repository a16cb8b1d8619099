#!/usr/bin/env python3
"""Writes benchmarks/structured.jsonl: the structured suite of issue 96, prompts whose answers follow
a JSON schema (each item's `response_format`, OpenAI's shape), in four categories: extraction of
fields from a passage, a record or config built from a description, a function's arguments taken
from a conversation, and enums with nested arrays. The passages are our own writing."""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).resolve().parent / "structured.jsonl"

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "email": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"type": "string"},
        "occupation": {"type": "string"},
    },
    "required": ["name", "email", "age", "city", "occupation"],
    "additionalProperties": False,
}
PEOPLE = [
    "Maria Gonzalez (maria.gonzalez@example.com), aged 34, lives in Valencia and works as a nurse at the city "
    "hospital.",
    "Our new hire is Tobias Lindqvist, 41, a structural engineer based in Gothenburg; reach him at "
    "t.lindqvist@example.org.",
    "Priya Raman is a 29-year-old data analyst from Chennai. Her work address is priya.raman@example.net.",
    "Contact: Kwame Mensah <kwame.mensah@example.com>. Kwame (52) runs a bakery in Kumasi.",
    "Hélène Dubois, a 38-year-old veterinarian in Lyon, can be reached at helene.dubois@example.fr.",
    "The speaker, Daniel O'Connor, is 45 and teaches mathematics in Cork. Email: daniel.oconnor@example.ie.",
    "Yuki Tanaka (yuki.tanaka@example.jp) is a 33-year-old game designer living in Osaka.",
    "Ana Silva, 27, software tester, Porto. Write to ana.silva@example.pt for the schedule.",
]
EVENT = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "date": {"type": "string"},
        "venue": {"type": "string"},
        "organizer": {"type": "string"},
        "ticket_price_eur": {"type": "number"},
    },
    "required": ["title", "date", "venue", "organizer", "ticket_price_eur"],
    "additionalProperties": False,
}
EVENTS = [
    "The Harbour Jazz Night takes place on 2027-03-14 at the Old Customs House, organised by the Port Arts "
    "Collective. Tickets cost 18.50 euros.",
    "Join the Riverside Book Fair on 2027-05-02 in the Municipal Library hall. The fair is run by Friends of "
    "the Library and entry is 5 euros.",
]
CONFIG = {
    "type": "object",
    "properties": {
        "service": {"type": "string"},
        "port": {"type": "integer"},
        "workers": {"type": "integer"},
        "log_level": {"type": "string", "enum": ["debug", "info", "warning", "error"]},
        "tls": {"type": "boolean"},
        "allowed_origins": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["service", "port", "workers", "log_level", "tls", "allowed_origins"],
    "additionalProperties": False,
}
CONFIGS = [
    "Write the config for the billing-api service: it listens on port 8443 with 4 workers, logs at warning "
    "level, uses TLS, and allows requests from https://shop.example.com and https://admin.example.com.",
    "Config for search-indexer: port 9200, 2 workers, debug logging, no TLS, allowed origin http://localhost:3000.",
    "The thumbnail-service needs port 7070, 8 workers, info logs, TLS on, and origins https://cdn.example.com, "
    "https://www.example.com and https://beta.example.com.",
    "Set up auth-gateway on port 443 with 16 workers and error-level logging; TLS is required; the only allowed "
    "origin is https://login.example.com.",
]
BOOK = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "author": {"type": "string"},
        "year": {"type": "integer"},
        "genres": {"type": "array", "items": {"type": "string"}},
        "isbn": {"type": "string"},
    },
    "required": ["title", "author", "year", "genres", "isbn"],
    "additionalProperties": False,
}
BOOKS = [
    "Catalogue this: 'The Salt Road' by Imani Okafor, published 2019, a historical novel and travel memoir, "
    "ISBN 978-0-00-123456-7.",
    "Record for 'Gardens of Glass' (Lena Hoffmann, 2022): science fiction, romance. ISBN 978-1-23-456789-0.",
    "Add 'A Short History of Bridges' by Rafael Ortega, 2015, non-fiction / engineering / history, "
    "ISBN 978-3-16-148410-0.",
    "New arrival: 'Midnight at the Observatory', written by Sun Mei in 2021, a mystery; ISBN 978-4-56-789012-3.",
]
CALLS = [
    (
        "get_weather",
        {"location": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "I'm flying to Reykjavik tomorrow. What's the weather like there? Give me celsius please.",
    ),
    (
        "book_table",
        {
            "restaurant": {"type": "string"},
            "date": {"type": "string"},
            "time": {"type": "string"},
            "party_size": {"type": "integer"},
        },
        "Please book a table at Casa Lucia for 2027-02-20 at 19:30, we are 6 people.",
    ),
    (
        "send_email",
        {"to": {"type": "string"}, "subject": {"type": "string"}, "body": {"type": "string"}},
        "Email jordan.blake@example.com with the subject 'Quarterly report' and tell him the report is attached "
        "and ready for review.",
    ),
    (
        "create_event",
        {
            "title": {"type": "string"},
            "start": {"type": "string"},
            "end": {"type": "string"},
            "attendees": {"type": "array", "items": {"type": "string"}},
        },
        "Put 'Design review' in my calendar from 2027-01-12T10:00 to 2027-01-12T11:00 with amara@example.com and "
        "li.wei@example.com.",
    ),
    (
        "convert_currency",
        {"amount": {"type": "number"}, "from_currency": {"type": "string"}, "to_currency": {"type": "string"}},
        "How much is 250 Swiss francs (CHF) in Japanese yen (JPY)?",
    ),
    (
        "search_flights",
        {
            "origin": {"type": "string"},
            "destination": {"type": "string"},
            "date": {"type": "string"},
            "passengers": {"type": "integer"},
        },
        "Find flights from Lisbon (LIS) to Montreal (YUL) on 2027-06-08 for 3 passengers.",
    ),
    (
        "set_reminder",
        {"text": {"type": "string"}, "when": {"type": "string"}},
        "Remind me to renew the car insurance on 2027-04-01 at 09:00.",
    ),
    (
        "translate",
        {"text": {"type": "string"}, "source_language": {"type": "string"}, "target_language": {"type": "string"}},
        "Translate 'the meeting has been moved to Thursday afternoon' from English to German.",
    ),
]
REVIEW = {
    "type": "object",
    "properties": {
        "sentiment": {"type": "string", "enum": ["positive", "neutral", "negative"]},
        "topics": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "topic": {"type": "string", "enum": ["price", "quality", "delivery", "service", "other"]},
                    "quote": {"type": "string"},
                },
                "required": ["topic", "quote"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["sentiment", "topics"],
    "additionalProperties": False,
}
REVIEWS = [
    "The blender arrived two days late, but the quality is excellent and the price was fair.",
    "Customer service never answered my emails. The jacket itself is fine.",
    "Great value for money! Fast delivery and the staff were very helpful on the phone.",
    "The chair broke after a week. Poor quality, and the refund took a month.",
    "Delivery was on time. The headphones sound okay, nothing special for the price.",
    "I love these boots: warm, waterproof and cheaper than in the shop. The courier was friendly too.",
    "Packaging was damaged and two plates were cracked. Support replaced them quickly though.",
    "The app subscription is too expensive for what it offers, and the quality of the recipes has dropped.",
]


def item(i: str, category: str, prompt: str, name: str, schema: dict) -> dict:
    return {
        "id": i,
        "category": category,
        "prompt": prompt,
        "response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}},
    }


def main() -> None:
    items = []
    for n, text in enumerate(PEOPLE, 1):
        items.append(
            item(f"extract-person-{n:02}", "extraction", f"Extract the person as JSON.\n\n{text}", "person", PERSON)
        )
    for n, text in enumerate(EVENTS, 1):
        items.append(
            item(f"extract-event-{n:02}", "extraction", f"Extract the event as JSON.\n\n{text}", "event", EVENT)
        )
    for n, text in enumerate(CONFIGS, 1):
        items.append(item(f"record-config-{n:02}", "record", text, "service_config", CONFIG))
    for n, text in enumerate(BOOKS, 1):
        items.append(item(f"record-book-{n:02}", "record", text, "book", BOOK))
    for name, props, text in CALLS:
        schema = {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}
        prompt = f"Call the function {name} for this request; answer with its arguments as JSON.\n\n{text}"
        items.append(item(f"call-{name}", "function-call", prompt, f"{name}_arguments", schema))
    for n, text in enumerate(REVIEWS, 1):
        prompt = f"Classify this review: its sentiment, and each topic it mentions with a quote.\n\n{text}"
        items.append(item(f"review-{n:02}", "enum-nested", prompt, "review", REVIEW))
    OUT.write_text("".join(json.dumps(i) + "\n" for i in items))
    print(f"{len(items)} prompts -> {OUT}")


if __name__ == "__main__":
    main()
