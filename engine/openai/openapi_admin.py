"""The hand-written parts of the OpenAPI document: the answers that have no pydantic model
(``/admin/engines``' ranks, ``/health``, ``/ready``, the stream events), and the reference form
every schema uses."""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]
JSON = "application/json"
REF_TEMPLATE = "#/components/schemas/{model}"


# The answers of a POST route besides 200 (401 too, with API keys): components/responses.
POST_ERRORS = {
    "400": "BadRequest",
    "404": "ModelNotFound",
    "408": "RequestTimeout",
    "413": "PayloadTooLarge",
    "429": "TooManyRequests",
    "503": "Unavailable",
}


def component_ref(name: str) -> Schema:
    """A reference to the component schema ``name``."""
    return {"$ref": REF_TEMPLATE.format(model=name)}


def _object(description: str, **props: Schema) -> Schema:
    """An object with all of ``props`` required."""
    schema = {"type": "object", "description": description, "properties": props}
    return schema | {"required": list(props)}


def hand_written_schemas() -> dict[str, Schema]:
    """Schemas of the answers that have no pydantic model."""
    count, number, text = {"type": "integer", "minimum": 0}, {"type": "number"}, {"type": "string"}
    maybe_int, flag = {"type": ["integer", "null"]}, {"type": "boolean"}
    stats = _object("Load (null until the rank's first report)", waiting=count, running=count)
    stats["properties"] |= {"kv_cache_usage": number, "prefix_cache_hit_rate": number}
    stats["properties"] |= {"draining": flag, "steps": count, "dummy_steps": count}
    stats["properties"] |= {"current_wave": count, "wave_running": flag}
    stats |= {"type": ["object", "null"], "required": list(stats["properties"])}
    state = {"enum": ["handshaking", "ready", "draining", "dead"]}
    rank = _object("A rank", rank=count, state=state, pod_name=text, pid=count, incarnation=count)
    rank["properties"] |= {"kv_cache_tokens": maybe_int, "max_model_len": maybe_int}
    rank["properties"] |= {"dp_size": maybe_int}
    rank["properties"] |= {"stats": stats, "dead_reason": {"type": ["string", "null"]}}
    rank["required"] = list(rank["properties"])
    ranks = {"type": "object", "additionalProperties": count}
    events = {}
    for name, chunk in (
        ("Completion", "CompletionStreamResponse"),
        ("ChatCompletion", "ChatCompletionChunk"),
    ):
        as_json = {
            "type": "string",
            "contentMediaType": JSON,
            "contentSchema": component_ref(chunk),
        }
        data = {"anyOf": [{"const": "[DONE]"}, as_json]}
        events[f"{name}Event"] = _object(f"`data`: a {chunk} as JSON, [DONE] last", data=data)
    return events | {
        "Health": _object("The process works", status={"const": "ok"}),
        "Readiness": _object("Whether a rank serves; ranks per state", ready=flag, ranks=ranks),
        "RankStatus": rank,
    }
