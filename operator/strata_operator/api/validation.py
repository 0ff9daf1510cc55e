"""Value rules of the CheckpointPolicy API: parsers and annotated field types, Kubernetes-exact.

Rule of this module: pure (no I/O, no Kubernetes client, no kopf). Each field type carries its
rule twice, with the same message: as JSON-schema ``pattern``/``x-kubernetes-validations`` (CEL,
enforced by the apiserver on create/update; :mod:`strata_operator.crdgen` copies them into the
CRD) and as a pydantic validator (what the operator applies to stored objects). Every message
names what is wrong and what to write instead.

Sources: quantities follow ``k8s.io/apimachinery/pkg/api/resource`` (``ParseQuantity``: binary
suffixes Ki..Ei, decimal n u m k M G T P E, integer decimal exponents ``e3``/``E3``); durations
follow Go's ``time.ParseDuration`` (what CEL's ``duration()`` uses; at most 2^63-1 ns); resource
names and the request/limit rules follow ``k8s.io/kubernetes/pkg/apis/core/validation``
(``ValidateResourceRequirements``); GCS object names follow
https://cloud.google.com/storage/docs/objects#naming; image references follow the OCI
distribution reference grammar (``reference.go`` of distribution/reference).

The values are computed by libraries, these functions being thin wrappers that keep the
apiserver's syntax and Strata's bounds and messages: quantities by ``kubernetes.utils.quantity``
(``parse_quantity``/``format_quantity``; pure ``Decimal`` code, the only import of the Kubernetes
client package here), durations by ``durationpy`` (what the client uses for them).

Bounds keep every field derived from a value valid: ``sizeLimit`` <= :data:`MAX_SIZE_LIMIT` keeps
the sidecar's memory limit and the startupProbe's ``failureThreshold`` (seconds per GiB) far below
int32/int64 limits.
"""

from __future__ import annotations

import re
from datetime import timedelta
from decimal import ROUND_CEILING, Decimal, DecimalException, localcontext
from typing import Annotated, Any, Final

import durationpy
from kubernetes.utils.quantity import format_quantity as _k8s_format_quantity
from kubernetes.utils.quantity import parse_quantity as _k8s_parse_quantity
from pydantic import AfterValidator, BeforeValidator, Field, WithJsonSchema

# --- quantities -------------------------------------------------------------------------------

QUANTITY_PATTERN: Final = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
"""The pattern the apiserver's OpenAPI uses for ``resource.Quantity`` (k8s.io/apimachinery)."""
_QUANTITY_RE = re.compile(QUANTITY_PATTERN)
_MAX_EXPONENT: Final = 1000
"""|decimal exponent| beyond which a quantity is refused outright (no resource needs 10^1000)."""

MAX_SIZE_LIMIT: Final = "32Ti"
"""Largest RAM tier: the largest machines offered have 32 TiB of memory."""
MIN_SIZE_LIMIT: Final = "1Mi"
MAX_CPU: Final = "4096"
"""Largest cpu request/limit of the sidecar (cores); far above any node, far below overflow."""
MIN_PROCESS_MEMORY: Final = "64Mi"
"""Smallest memory the sidecar process can run in (Python + buffers); below it, it is OOM-killed."""
MAX_PROCESS_MEMORY: Final = "1Ti"
MAX_STORAGE: Final = "1Pi"
MAX_EXTENDED: Final = 1_000_000
"""Largest count of an extended resource (GPUs, ...)."""


def parse_quantity(value: str) -> Decimal:
    """Value of a Kubernetes quantity (``"16Gi"`` -> 17179869184, ``"2E"`` -> 2*10^18).

    ValueError (never another exception) when ``value`` is not a quantity the apiserver parses.
    The apiserver's pattern (:data:`QUANTITY_PATTERN`) decides the syntax, since
    ``kubernetes.utils.parse_quantity`` (which computes the value) also takes what ``Decimal``
    takes (``Infinity``, ``1_000``, ``1K``); an exponent above :data:`_MAX_EXPONENT` is refused.
    """
    text = str(value).strip()
    if not _QUANTITY_RE.match(text):
        raise ValueError(
            f"{value!r} is not a Kubernetes quantity; write e.g. 512Mi, 16Gi, 500m or 1000000000"
        )
    try:
        number: Decimal = _k8s_parse_quantity(text)  # type: ignore[no-untyped-call]
    except (ValueError, DecimalException):
        # The pattern admits a fractional exponent ("1e1.5"); ParseQuantity refuses it.
        raise ValueError(
            f"{value!r}: the exponent of a quantity must be a whole number (e.g. 1e9)"
        ) from None
    exponent = number.as_tuple().exponent
    if not isinstance(exponent, int) or max(abs(exponent), abs(number.adjusted())) > _MAX_EXPONENT:
        raise ValueError(f"{value!r} is out of range; write a value like 16Gi")
    return number


def format_quantity(value: Decimal | int, suffix: str = "") -> str:
    """``value`` as a quantity in whole units of ``suffix``, rounded up to the next unit
    (``Decimal("1.3505"), "m"`` -> ``"1351m"``; ``2**31, "Gi"`` -> ``"2Gi"``; ``1000`` ->
    ``"1000"``), written by ``kubernetes.utils.format_quantity``.

    Rounded up because a request written smaller than the sum it stands for is refused by the
    apiserver (pod-level requests >= the containers'). ValueError on an unknown suffix or a value
    that is not finite.
    """
    with localcontext() as ctx:
        ctx.prec = 64  # int64 bytes or millicores, and the digits below them, stay exact
        ctx.rounding = ROUND_CEILING
        try:
            if suffix:
                return str(_k8s_format_quantity(Decimal(value), suffix, quantize=Decimal(1)))
            # format_quantity only quantizes with a suffix; a whole number is written plainly.
            return str(_k8s_format_quantity(Decimal(value).quantize(Decimal(1)), ""))
        except (ValueError, DecimalException):
            raise ValueError(
                f"{value!r} cannot be written as a Kubernetes quantity in {suffix or 'units'}"
            ) from None


def quantity_bytes(value: str) -> int:
    """A quantity as whole bytes, rounded up (Kubernetes rounds memory quantities up too)."""
    return int(parse_quantity(value).to_integral_value(rounding=ROUND_CEILING))


def _int_to_str(value: Any) -> Any:
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return value


def _check_quantity(value: str) -> str:
    parse_quantity(value)
    return value


Quantity = Annotated[
    str,
    BeforeValidator(_int_to_str),
    AfterValidator(_check_quantity),
    WithJsonSchema(
        {
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "pattern": QUANTITY_PATTERN,
            "x-kubernetes-int-or-string": True,
        }
    ),
]
"""A Kubernetes quantity (``500m``, ``2Gi``, or an integer), as in ``resources.limits``."""

SIZE_LIMIT_MESSAGE: Final = (
    f"sizeLimit must be at least {MIN_SIZE_LIMIT} and at most {MAX_SIZE_LIMIT}; size the RAM "
    "tier for the shards a pod holds (e.g. 16Gi)"
)


def _check_size_limit(value: str) -> str:
    size = parse_quantity(value)
    if not parse_quantity(MIN_SIZE_LIMIT) <= size <= parse_quantity(MAX_SIZE_LIMIT):
        raise ValueError(f"{SIZE_LIMIT_MESSAGE} (got {value!r})")
    return value


SizeLimit = Annotated[
    str,
    Field(max_length=64),
    AfterValidator(_check_size_limit),
    WithJsonSchema(
        {
            "type": "string",
            "maxLength": 64,
            "pattern": QUANTITY_PATTERN,
            "x-kubernetes-validations": [
                {
                    "rule": f"quantity(self).compareTo(quantity('{MIN_SIZE_LIMIT}')) >= 0 && "
                    f"quantity(self).compareTo(quantity('{MAX_SIZE_LIMIT}')) <= 0",
                    "message": SIZE_LIMIT_MESSAGE,
                }
            ],
        }
    ),
]

# --- durations --------------------------------------------------------------------------------

DURATION_PATTERN: Final = r"^([0-9]+(\.[0-9]+)?(ns|us|µs|μs|ms|s|m|h))+$"
"""Go ``time.ParseDuration`` syntax without sign (``90s``, ``15m``, ``1h30m``), as CEL's duration()."""
_DURATION_RE = re.compile(DURATION_PATTERN)
MAX_DURATION_NS: Final = 2**63 - 1
"""Go's ``time.Duration`` is an int64 of nanoseconds: at most 2562047h47m16.854775807s."""
_MAX_DURATION: Final = timedelta(microseconds=-(-MAX_DURATION_NS // 1000))
""":data:`MAX_DURATION_NS` rounded up to durationpy's resolution (a microsecond)."""
_DURATION_RANGE_MESSAGE: Final = "is out of range: at most 2562047h (about 292 years)"


def parse_duration(value: str) -> float:
    """Seconds of a Go duration string (``"1h30m"`` -> 5400.0), to the microsecond.

    ValueError when malformed or when Go would overflow (more than 2562047h47m16s). The syntax
    is :data:`DURATION_PATTERN` (what CEL's ``duration()`` takes): ``durationpy``, which computes
    the value, also takes a sign and Go-foreign units (``d``, ``w``, ``y``). durationpy sums in
    float nanoseconds and rounds to a ``timedelta`` (microseconds), so the bounds here hold to
    about a microsecond: ``999999999ns`` counts as 1s, and the overflow bound may let a value up
    to a microsecond above Go's pass (the apiserver's CEL, exact, still refuses it on create).
    """
    if not _DURATION_RE.match(value):
        raise ValueError(f"{value!r} is not a duration; write e.g. 90s, 15m or 1h30m")
    try:
        delta = durationpy.from_str(value)
    except (ValueError, OverflowError):  # beyond timedelta's 999999999 days, or float infinity
        raise ValueError(f"duration {value!r} {_DURATION_RANGE_MESSAGE}") from None
    if delta > _MAX_DURATION:
        raise ValueError(f"duration {value!r} {_DURATION_RANGE_MESSAGE}")
    return delta.total_seconds()


def _check_duration(value: str) -> str:
    if parse_duration(value) < 1:
        raise ValueError(f"duration must be at least 1s (got {value!r}); write e.g. 30s, 15m or 1h")
    return value


Duration = Annotated[
    str,
    Field(max_length=32),
    AfterValidator(_check_duration),
    WithJsonSchema(
        {
            "type": "string",
            "maxLength": 32,
            "pattern": DURATION_PATTERN,
            "x-kubernetes-validations": [
                {
                    "rule": "duration(self) >= duration('1s')",
                    "message": "duration must be at least 1s and at most 2562047h; write e.g. "
                    "30s, 15m or 1h",
                }
            ],
        }
    ),
]

# --- names and paths --------------------------------------------------------------------------

DNS_SUBDOMAIN_PATTERN: Final = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
ObjectName = Annotated[str, Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)]
"""A Kubernetes object name (DNS-1123 subdomain), e.g. a PVC or Secret name."""
MAX_POLICY_NAME: Final = 63
"""A policy's name is the value of the pods' ``strata.dev/policy`` label: at most 63 characters."""
POLICY_NAME_MESSAGE: Final = (
    "metadata.name must be at most 63 characters: pods name the policy in the label "
    "strata.dev/policy, and a label value is at most 63 characters; choose a shorter name"
)


def check_policy_name(name: str) -> str:
    """``name`` when it fits a label value; ValueError with :data:`POLICY_NAME_MESSAGE`."""
    if len(name) > MAX_POLICY_NAME:
        raise ValueError(f"{POLICY_NAME_MESSAGE} (got {len(name)} characters)")
    return name


_NO_DOT_SEGMENTS_RULE: Final = "!self.split('/').exists(p, p == '..' || p == '.')"

RELATIVE_PATH_PATTERN: Final = r"^[^/\x00-\x1f\x7f][^\x00-\x1f\x7f]*$"


def _check_relative(value: str) -> str:
    if any(p in ("..", ".") for p in value.split("/")):
        raise ValueError("must be a relative path without '.' or '..' segments (e.g. runs/llm)")
    return value


RelativePath = Annotated[
    str,
    Field(max_length=1024, pattern=RELATIVE_PATH_PATTERN),
    AfterValidator(_check_relative),
    WithJsonSchema(
        {
            "type": "string",
            "maxLength": 1024,
            "pattern": RELATIVE_PATH_PATTERN,
            "x-kubernetes-validations": [
                {
                    "rule": _NO_DOT_SEGMENTS_RULE,
                    "message": "must be a relative path without '.' or '..' segments "
                    "(e.g. runs/llm)",
                }
            ],
        }
    ),
]
"""A sub-directory of a volume (``subPath``): relative, no ``.``/``..``, no control characters."""

HOST_PATH_PATTERN: Final = r"^(/[^/\x00-\x1f\x7f]+)+$"
"""Absolute, no empty segment, no trailing '/', no control character (NUL, CR, LF, ...)."""
FORBIDDEN_HOST_PATHS: Final = (
    "/etc",
    "/proc",
    "/sys",
    "/boot",
    "/root",
    "/bin",
    "/sbin",
    "/lib",
    "/lib64",
    "/usr",
    "/run",
    "/var/run",
    "/var/lib/kubelet",
    "/var/lib/containerd",
    "/var/lib/docker",
    "/var/log",
)
"""Node directories a RAM tier must never be placed in or below (system state, kubelet, runtime)."""
HOST_PATH_MESSAGE: Final = (
    "hostPath must be an absolute node directory for the RAM tier, e.g. /dev/shm/strata: no "
    "'.' or '..' segments, no control characters, not /, /dev (except /dev/shm/...), /etc, "
    "/proc, /sys, /var/lib/kubelet or another system directory"
)
_HOST_PATH_RULE: Final = (
    _NO_DOT_SEGMENTS_RULE
    + " && !(self == '/dev' || (self.startsWith('/dev/') && self != '/dev/shm' && "
    "!self.startsWith('/dev/shm/')))"
    + " && !["
    + ", ".join(f"'{p}'" for p in FORBIDDEN_HOST_PATHS)
    + "].exists(d, self == d || self.startsWith(d + '/'))"
)


def check_host_path(value: str) -> str:
    """``value`` when it is an acceptable node directory; ValueError with :data:`HOST_PATH_MESSAGE`."""
    bad = (
        not re.match(HOST_PATH_PATTERN, value)
        or any(p in (".", "..") for p in value.split("/"))
        or value == "/dev"
        or (value.startswith("/dev/") and value != "/dev/shm" and not value.startswith("/dev/shm/"))
        or any(value == d or value.startswith(d + "/") for d in FORBIDDEN_HOST_PATHS)
    )
    if bad:
        raise ValueError(f"{HOST_PATH_MESSAGE} (got {value!r})")
    return value


HostPath = Annotated[
    str,
    Field(max_length=1024),
    AfterValidator(check_host_path),
    WithJsonSchema(
        {
            "type": "string",
            "maxLength": 1024,
            "pattern": HOST_PATH_PATTERN,
            "x-kubernetes-validations": [{"rule": _HOST_PATH_RULE, "message": HOST_PATH_MESSAGE}],
        }
    ),
]

# --- GCS --------------------------------------------------------------------------------------

BUCKET_PATTERN: Final = r"^[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]$"
"""Characters and ends of a bucket name (https://cloud.google.com/storage/docs/buckets#naming)."""
BUCKET_RULES: Final[tuple[tuple[str, str], ...]] = (
    (
        "!self.contains('.') ? size(self) <= 63 : !self.matches('[^.]{64}')",
        "bucket names are at most 63 characters (222 with dots, each dot-separated part at most 63)",
    ),
    ("!self.startsWith('goog')", "bucket names cannot begin with 'goog'"),
    (
        "!self.matches('g[o0][o0]g[l1]e')",
        "bucket names cannot contain 'google' or close misspellings",
    ),
    (
        "!self.matches('^[0-9]{1,3}([.][0-9]{1,3}){3}$')",
        "bucket names cannot be an IP address in dotted-decimal notation",
    ),
    (
        "!self.contains('..') && !self.contains('.-') && !self.contains('-.')",
        "bucket names cannot contain '..', '.-' or '-.' (dot-separated parts must be DNS labels)",
    ),
)


def check_bucket_name(name: str) -> str:
    """Return ``name`` when it is a valid GCS bucket name; ValueError naming the broken rule.

    Mirrors :data:`BUCKET_PATTERN` and :data:`BUCKET_RULES` (what the apiserver checks).
    """
    problems: list[str] = []
    if not re.match(BUCKET_PATTERN, name):
        problems.append(
            "bucket names are 3-222 characters of lowercase letters, digits, '-', '_' and '.', "
            "starting and ending with a letter or digit"
        )
    if ("." not in name and len(name) > 63) or re.search(r"[^.]{64}", name):
        problems.append(BUCKET_RULES[0][1])
    if name.startswith("goog"):
        problems.append(BUCKET_RULES[1][1])
    if re.search(r"g[o0][o0]g[l1]e", name):
        problems.append(BUCKET_RULES[2][1])
    if re.match(r"^[0-9]{1,3}([.][0-9]{1,3}){3}$", name):
        problems.append(BUCKET_RULES[3][1])
    if ".." in name or ".-" in name or "-." in name:
        problems.append(BUCKET_RULES[4][1])
    if problems:
        raise ValueError(f"invalid bucket name {name!r}: " + "; ".join(problems))
    return name


BucketName = Annotated[
    str,
    AfterValidator(check_bucket_name),
    WithJsonSchema(
        {
            "type": "string",
            "minLength": 3,
            "maxLength": 222,
            "pattern": BUCKET_PATTERN,
            "x-kubernetes-validations": [{"rule": r, "message": m} for r, m in BUCKET_RULES],
        }
    ),
]

MAX_PREFIX_BYTES: Final = 256
"""A prefix leaves room for the rest of every object name within GCS' 1,024-byte limit: a job
id (at most 512 characters of ASCII) and ``/steps/<12 digits>/rank-<5 digits>.manifest``."""
PREFIX_PATTERN: Final = r"^([^/\x00-\x1f\x7f]+(/[^/\x00-\x1f\x7f]+)*)?$"
"""Segments separated by single '/', no leading or trailing '/', no control characters."""
PREFIX_MESSAGE: Final = (
    "prefix must be '/'-separated segments (no leading, trailing or double '/', no '.' or '..' "
    f"segment, no control characters), at most {MAX_PREFIX_BYTES} bytes in UTF-8; e.g. "
    "teams/llm"
)


def check_prefix(value: str) -> str:
    """``value`` when it is a usable object-name prefix; ValueError with :data:`PREFIX_MESSAGE`."""
    bad = (
        not re.match(PREFIX_PATTERN, value)
        or any(p in (".", "..") for p in value.split("/"))
        or len(value.encode("utf-8")) > MAX_PREFIX_BYTES
        or value.startswith(".well-known/acme-challenge")
    )
    if bad:
        raise ValueError(f"{PREFIX_MESSAGE} (got {value!r})")
    return value


GcsPrefix = Annotated[
    str,
    Field(max_length=MAX_PREFIX_BYTES),
    AfterValidator(check_prefix),
    WithJsonSchema(
        {
            "type": "string",
            "maxLength": MAX_PREFIX_BYTES,
            "pattern": PREFIX_PATTERN,
            "x-kubernetes-validations": [
                {
                    "rule": f"{_NO_DOT_SEGMENTS_RULE} && size(bytes(self)) <= {MAX_PREFIX_BYTES}"
                    " && !self.startsWith('.well-known/acme-challenge')",
                    "message": PREFIX_MESSAGE,
                }
            ],
        }
    ),
]

# --- GCS endpoint ------------------------------------------------------------------------------

_LABEL = "[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
GCS_ENDPOINT_PATTERN: Final = rf"^https?://{_LABEL}([.]{_LABEL})*(:[0-9]{{1,5}})?$"
"""``http[s]://host[:port]``: a DNS name or an IPv4 address; no path, query or credentials (the
storage client appends its own paths). No backslash, so that it reads the same in CEL (RE2)."""
MAX_GCS_ENDPOINT: Final = 270
GCS_ENDPOINT_MESSAGE: Final = (
    "tiers.gcs.endpoint must be http[s]://host[:port] with no path, e.g. "
    "https://storage-myendpoint.p.googleapis.com (Private Service Connect) or "
    "http://10.0.0.5:4443 (an emulator, anonymous); leave it unset for "
    "https://storage.googleapis.com"
)


def check_gcs_endpoint(value: str) -> str:
    """``value`` if it matches `GCS_ENDPOINT_PATTERN`; raises ValueError with
    `GCS_ENDPOINT_MESSAGE` otherwise."""
    if len(value) > MAX_GCS_ENDPOINT or not re.match(GCS_ENDPOINT_PATTERN, value):
        raise ValueError(f"{GCS_ENDPOINT_MESSAGE} (got {value!r})")
    return value


GcsEndpoint = Annotated[
    str,
    AfterValidator(check_gcs_endpoint),
    WithJsonSchema(
        {
            "type": "string",
            "maxLength": MAX_GCS_ENDPOINT,
            "x-kubernetes-validations": [
                {"rule": f"self.matches('{GCS_ENDPOINT_PATTERN}')", "message": GCS_ENDPOINT_MESSAGE}
            ],
        }
    ),
]
"""The API endpoint of a GCS-compatible service (see `GCS_ENDPOINT_PATTERN`)."""


# --- image references -------------------------------------------------------------------------

_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_DOMAIN_PART = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
IMAGE_PATTERN: Final = (
    rf"^(?:{_DOMAIN_PART}(?:\.{_DOMAIN_PART})+(?::[0-9]+)?/|{_DOMAIN_PART}:[0-9]+/|localhost/)?"
    rf"{_COMPONENT}(?:/{_COMPONENT})*"
    r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?"
    r"(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?$"
)
"""An image reference: ``[registry[:port]/]path[:tag][@digest]``, path lowercase (OCI grammar)."""
IMAGE_MESSAGE: Final = (
    "image must be an image reference like registry.example.com/team/strata:0.1.0 or "
    "...@sha256:<64 hex digits> (lowercase repository path, tag of letters, digits, '_', '.', '-')"
)


def check_image(value: str) -> str:
    if not re.match(IMAGE_PATTERN, value):
        raise ValueError(f"{IMAGE_MESSAGE} (got {value!r})")
    return value


ImageReference = Annotated[
    str,
    Field(min_length=1, max_length=1024),
    AfterValidator(check_image),
    WithJsonSchema({"type": "string", "minLength": 1, "maxLength": 1024, "pattern": IMAGE_PATTERN}),
]

# --- container resources ----------------------------------------------------------------------

STANDARD_RESOURCES: Final = ("cpu", "memory", "ephemeral-storage")
HUGEPAGES_PATTERN: Final = r"^hugepages-[0-9]+(Ki|Mi|Gi)$"
EXTENDED_PATTERN: Final = (
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
    r"/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
"""An extended resource (``nvidia.com/gpu``): a domain-prefixed name, as corev1 requires."""
RESOURCE_NAME_MESSAGE: Final = (
    "resource names are cpu, memory, ephemeral-storage, hugepages-<size> or a domain-prefixed "
    "extended resource such as nvidia.com/gpu (not in the kubernetes.io or k8s.io domains)"
)
_RESERVED_DOMAINS_RULE: Final = (
    "!(k.startsWith('kubernetes.io/') || k.contains('.kubernetes.io/') || "
    "k.startsWith('k8s.io/') || k.contains('.k8s.io/') || k.startsWith('requests.'))"
)
_NAME_RULE: Final = (
    "self.all(k, k in ['cpu', 'memory', 'ephemeral-storage'] || "
    f"k.matches('{HUGEPAGES_PATTERN}') || (k.matches('{EXTENDED_PATTERN}') && "
    f"{_RESERVED_DOMAINS_RULE}))"
)
_Q = "quantity(string(self[k]))"
_VALUE_RULES: Final[tuple[tuple[str, str], ...]] = (
    (
        f"self.all(k, !{_Q}.isLessThan(quantity('0')))",
        "resource quantities must not be negative",
    ),
    (
        f"self.all(k, k != 'cpu' || {_Q}.compareTo(quantity('{MAX_CPU}')) <= 0)",
        f"cpu must be at most {MAX_CPU} (cores); write e.g. 250m or 2",
    ),
    (
        f"self.all(k, k != 'memory' || ({_Q}.compareTo(quantity('{MIN_PROCESS_MEMORY}')) >= 0 "
        f"&& {_Q}.compareTo(quantity('{MAX_PROCESS_MEMORY}')) <= 0))",
        f"memory (the sidecar process, on top of the RAM tier) must be between "
        f"{MIN_PROCESS_MEMORY} and {MAX_PROCESS_MEMORY}; write e.g. 256Mi",
    ),
    (
        f"self.all(k, k != 'ephemeral-storage' || {_Q}.compareTo(quantity('{MAX_STORAGE}')) <= 0)",
        f"ephemeral-storage must be at most {MAX_STORAGE}",
    ),
    (
        f"self.all(k, !k.contains('/') || ({_Q}.isInteger() && "
        f"{_Q}.compareTo(quantity('{MAX_EXTENDED}')) <= 0))",
        f"extended resources (such as nvidia.com/gpu) must be whole numbers up to {MAX_EXTENDED}",
    ),
    (
        f"self.all(k, !k.matches('{HUGEPAGES_PATTERN}') || "
        "(quantity(k.substring(10)).isInteger() && quantity(k.substring(10)).asInteger() > 0 && "
        f"{_Q}.isInteger() && "
        f"{_Q}.asInteger() % quantity(k.substring(10)).asInteger() == 0))",
        "hugepages-<size> quantities must be whole multiples of the page size <size> (e.g. "
        "hugepages-2Mi: 4Mi, not 3Mi)",
    ),
)


def check_resource_list(values: dict[str, str]) -> dict[str, str]:
    """Names and values of one ``requests`` or ``limits`` map; ValueError naming each problem."""
    problems: list[str] = []
    for name, text in values.items():
        if not _resource_name_ok(name):
            problems.append(f"{name!r}: {RESOURCE_NAME_MESSAGE}")
            continue
        value = parse_quantity(text)
        if value < 0:
            problems.append(f"{name}: {_VALUE_RULES[0][1]} (got {text!r})")
        elif name == "cpu" and value > parse_quantity(MAX_CPU):
            problems.append(f"{name}: {_VALUE_RULES[1][1]} (got {text!r})")
        elif name == "memory" and not (
            parse_quantity(MIN_PROCESS_MEMORY) <= value <= parse_quantity(MAX_PROCESS_MEMORY)
        ):
            problems.append(f"{name}: {_VALUE_RULES[2][1]} (got {text!r})")
        elif name == "ephemeral-storage" and value > parse_quantity(MAX_STORAGE):
            problems.append(f"{name}: {_VALUE_RULES[3][1]} (got {text!r})")
        elif "/" in name and (value != value.to_integral_value() or value > MAX_EXTENDED):
            problems.append(f"{name}: {_VALUE_RULES[4][1]} (got {text!r})")
        elif name.startswith("hugepages-") and not _whole_pages(name, value):
            problems.append(f"{name}: {_VALUE_RULES[5][1]} (got {text!r})")
    if problems:
        raise ValueError("; ".join(problems))
    return values


def _whole_pages(name: str, value: Decimal) -> bool:
    """Whether ``value`` (bytes) of the resource ``hugepages-<size>`` is a whole number of pages."""
    page = parse_quantity(name.removeprefix("hugepages-"))
    return page > 0 and value == value.to_integral_value() and value % page == 0


def _resource_name_ok(name: str) -> bool:
    if name in STANDARD_RESOURCES or re.match(HUGEPAGES_PATTERN, name):
        return True
    if not re.match(EXTENDED_PATTERN, name) or len(name) > 253 + 1 + 63:
        return False
    domain = name.split("/", 1)[0]
    reserved = any(domain == d or domain.endswith("." + d) for d in ("kubernetes.io", "k8s.io"))
    return not reserved and not name.startswith("requests.")


ResourceList = Annotated[
    dict[str, Quantity],
    Field(max_length=8),
    AfterValidator(check_resource_list),
    WithJsonSchema(
        {
            "type": "object",
            "maxProperties": 8,
            "additionalProperties": {
                "anyOf": [{"type": "integer"}, {"type": "string"}],
                "maxLength": 64,
                "pattern": QUANTITY_PATTERN,
                "x-kubernetes-int-or-string": True,
            },
            "x-kubernetes-validations": [
                {"rule": _NAME_RULE, "message": RESOURCE_NAME_MESSAGE},
                *({"rule": r, "message": m} for r, m in _VALUE_RULES),
            ],
        }
    ),
]
"""A corev1 ``ResourceList`` with the sidecar's bounds (names, non-negative, upper bounds)."""

REQUEST_ABOVE_LIMIT_MESSAGE: Final = (
    "a request must not exceed its limit (resources.requests.X <= resources.limits.X); raise "
    "the limit or lower the request"
)
EXTENDED_NEEDS_LIMIT_MESSAGE: Final = (
    "extended resources and hugepages (such as nvidia.com/gpu) cannot be overcommitted: set "
    "them in resources.limits, and a request, if given, equal to the limit"
)
REQUEST_NOT_ABOVE_LIMIT_RULE: Final = (
    "!has(self.requests) || !has(self.limits) || self.requests.all(k, !(k in self.limits) || "
    "quantity(string(self.requests[k])).compareTo(quantity(string(self.limits[k]))) <= 0)"
)
EXTENDED_NEEDS_LIMIT_RULE: Final = (
    "!has(self.requests) || self.requests.all(k, !(k.contains('/') || "
    "k.startsWith('hugepages-')) || (has(self.limits) && k in self.limits && "
    "quantity(string(self.requests[k])).compareTo(quantity(string(self.limits[k]))) == 0))"
)


def check_requirements(requests: dict[str, str], limits: dict[str, str]) -> None:
    """corev1's cross rules of ``requests`` and ``limits``; ValueError naming each resource."""
    problems: list[str] = []
    for name, text in requests.items():
        limit = limits.get(name)
        overcommit_free = "/" in name or name.startswith("hugepages-")
        if overcommit_free and (limit is None or parse_quantity(limit) != parse_quantity(text)):
            problems.append(f"{name}: {EXTENDED_NEEDS_LIMIT_MESSAGE}")
        elif limit is not None and parse_quantity(text) > parse_quantity(limit):
            problems.append(
                f"{name}: {REQUEST_ABOVE_LIMIT_MESSAGE} (request {text!r} > limit {limit!r})"
            )
    if problems:
        raise ValueError("; ".join(problems))
