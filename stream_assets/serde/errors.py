"""What the schema-bound serdes (Avro, Protobuf) raise.

A record's failure becomes its dead letter with ``Type: message`` as the
reason, so every message starts with the format and the schema's name, then
says what is wrong: the reason alone should tell the user what to fix.
"""

from __future__ import annotations


class SerdeError(ValueError):
    """Base of the serde errors (a ValueError, like a JSON decoding error)."""


class SchemaError(SerdeError):
    """A schema or message class that cannot be used: raised when the serde is made."""


class DecodeError(SerdeError):
    """A body that is not a datum of the deserializer's schema."""


class EncodeError(SerdeError):
    """A value the serializer's schema cannot encode."""
