"""Structured generation: a `gen` constrained by a regular expression, and one by a JSON schema.
The runtime masks every token that would leave the pattern, so the output always parses.

    python examples/json_extraction.py [--url http://127.0.0.1:30000]
"""

from __future__ import annotations

import argparse
import json

import radixrt as sgl

DATE_REGEX = r"\d{4}-\d{2}-\d{2}"
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 16},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}

TEXT = "Alice Martin was born on 14 March 1993. She is 31 years old and lives in Lyon."


@sgl.function
def extract_date(s, text):
    s += sgl.user(f"{text}\nWhat is her date of birth, as YYYY-MM-DD?")
    s += sgl.assistant(sgl.gen("date", max_tokens=12, regex=DATE_REGEX))


@sgl.function
def extract_person(s, text):
    s += sgl.user(f"{text}\nDescribe the person as JSON with name, age and city.")
    s += sgl.assistant(sgl.gen("person", max_tokens=48, json_schema=PERSON_SCHEMA))


def main(backend=None, text=TEXT):
    backend = backend or sgl.get_default_backend()
    date = extract_date.run(text=text, backend=backend, temperature=0)
    person = extract_person.run(text=text, backend=backend, temperature=0)
    for state in (date, person):
        if state.error() is not None:
            raise state.error()
    print(f"date of birth (regex {DATE_REGEX}): {date['date']}")
    print(f"person (JSON schema): {person['person']}")
    print(f"parsed: {json.loads(person['person'])}")
    return date, person


def backend_from_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running `radixrt serve` (default: the in-process engine)")
    args = parser.parse_args(argv)
    return sgl.RuntimeEndpoint(args.url) if args.url else sgl.Engine()


if __name__ == "__main__":
    sgl.set_default_backend(backend_from_args())
    main()
