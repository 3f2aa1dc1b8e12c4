from .encoding import (
    IMAGE_PLACEHOLDER,
    PRE_RELEASE_EFFORT_TABLE,
    RELEASE_EFFORT_TABLE,
    EncodingError,
    ParseError,
    encode_case,
    encode_messages,
    load_cases,
    parse_message_from_completion_text,
    parse_tagged_text,
    resolve_reasoning_effort,
    to_json,
)
