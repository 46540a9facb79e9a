"""What a job key declares beside its type and bounds: the model families it is for, and whether it decides the
trained weights (the job's identity). Declared once, on the field, with `key(...)`; the family key tables,
dump_job and JobConfig.identity() are derived from these declarations (engine/config/job.py, rules.py).
"""

from __future__ import annotations

from typing import Any, Literal, Union, get_args

from pydantic import BaseModel, ConfigDict, Field
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from engine.registry.families import edit_families, names

# Derived from the family packages' declarations (engine/registry/families.py), in the order families joined.
LM = names("text")
# The families that train on images (engine/families/image/), video included.
IMAGE_FAMILIES = names("image", "edit", "video")
# Of those, the ones that train on clips (engine/families/video/), and the ones that train on stills only.
VIDEO_FAMILIES = names("video")
STILL_FAMILIES = tuple(f for f in IMAGE_FAMILIES if f not in VIDEO_FAMILIES)
FAMILIES = (*LM, *IMAGE_FAMILIES)
# The image families that train edit LoRAs on an edit base (data.control_path; engine/config/controls.py).
EDIT_FAMILIES = edit_families()

# identity=PARTS: the section's presence alone does not change the weights; only its own identity keys count,
# and the section is left out of the identity when none of them is set.
PARTS = "parts"
Identity = Union[bool, Literal["parts"]]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def key(default: Any = PydanticUndefined, *, families: tuple[str, ...] = FAMILIES,
        read_by: tuple[str, ...] | None = None, identity: Identity = True, dump_default: bool = True,
        **field: Any) -> Any:
    """A pydantic Field with the declarations above.

    families: the families the key is for; set on another family's job it is refused, and dump_job leaves it out.
    read_by: the families whose trainer reads it so far (default: all of families); the others refuse it when set.
    identity: False for what may change between attempts without invalidating a checkpoint; PARTS, see above.
    dump_default: False leaves the key out of dump_job while it holds its default (a key added after jobs were
    written: their normalised dumps stay byte for byte what they were).
    """
    extra = {"families": families, "read_by": read_by or families, "identity": identity}
    if not dump_default:
        extra["dump_default"] = False
    return Field(default, json_schema_extra=extra, **field)


def declared(field: FieldInfo, name: str) -> Any:
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    return extra.get(name, {"families": FAMILIES, "read_by": FAMILIES, "identity": True, "dump_default": True}[name])


def section_type(field: FieldInfo) -> type[BaseModel] | None:
    """The section model a field holds (`EmaConfig | None` included), or None for a plain value."""
    for t in (field.annotation, *get_args(field.annotation)):
        if isinstance(t, type) and issubclass(t, BaseModel):
            return t
    return None


def identity_part(model: type[BaseModel], dumped: dict[str, Any]) -> dict[str, Any]:
    """The part of a section's dump (model_dump, defaults excluded) that its identity declarations keep."""
    out: dict[str, Any] = {}
    for name, value in dumped.items():
        field = model.model_fields[name]
        mode = declared(field, "identity")
        if mode is False:
            continue
        sub = section_type(field)
        if sub is not None and isinstance(value, dict):
            value = identity_part(sub, value)
            if mode == PARTS and not value:
                continue
        out[name] = value
    return out


def drop_other_families(model: type[BaseModel], dumped: dict[str, Any], family: str) -> None:
    """Remove, in place, the keys of a section's dump that are not for `family` (they only hold defaults)."""
    for name in list(dumped):
        field = model.model_fields[name]
        if family not in declared(field, "families"):
            del dumped[name]
        elif (sub := section_type(field)) is not None and isinstance(dumped[name], dict):
            drop_other_families(sub, dumped[name], family)


def drop_quiet_defaults(model: type[BaseModel], dumped: dict[str, Any]) -> None:
    """Remove, in place, the keys declared dump_default=False that hold their default."""
    for name in list(dumped):
        field = model.model_fields[name]
        if not declared(field, "dump_default") and dumped[name] == field.get_default(call_default_factory=True):
            del dumped[name]
        elif (sub := section_type(field)) is not None and isinstance(dumped[name], dict):
            drop_quiet_defaults(sub, dumped[name])


def keys_set_but_not_for(section: BaseModel, family: str, prefix: str = "") -> list[str]:
    """Dotted keys the job file sets (by presence) that are not for `family`, in field order."""
    out: list[str] = []
    for name, field in type(section).model_fields.items():
        dotted = f"{prefix}{name}"
        if family not in declared(field, "families"):
            if name in section.model_fields_set:
                out.append(dotted)
        elif isinstance(value := getattr(section, name), BaseModel):
            out += keys_set_but_not_for(value, family, f"{dotted}.")
    return out


def keys_not_read_by(section: BaseModel, family: str, prefix: str = "") -> list[str]:
    """Dotted keys for `family` that hold a value (not None) although its trainer does not read them yet."""
    out: list[str] = []
    for name, field in type(section).model_fields.items():
        dotted, value = f"{prefix}{name}", getattr(section, name)
        if family not in declared(field, "families"):
            continue
        if family not in declared(field, "read_by"):
            if value is not None:
                out.append(dotted)
        elif isinstance(value, BaseModel):
            out += keys_not_read_by(value, family, f"{dotted}.")
    return out


def read_only_by(section: type[BaseModel], dotted: str) -> tuple[str, ...]:
    """The read_by declaration of a dotted key, looked up from the top section."""
    model: type[BaseModel] | None = section
    field = None
    for part in dotted.split("."):
        assert model is not None
        field = model.model_fields[part]
        model = section_type(field)
    assert field is not None
    return declared(field, "read_by")
