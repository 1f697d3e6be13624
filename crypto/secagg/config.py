"""Round configuration of the secure-aggregation protocol (docs/protocol.md §4.2, §6): the cohort,
the Shamir threshold t, the round id and salt, and the release plan (one :class:`ReleaseSpec` per
aggregate).

Thresholds.
    Round threshold t (default ⌊n/2⌋ + 1, a majority of the cohort of n sites): every stage needs
    at least t live clients or the round aborts with no release, and every secret is shared
    t-of-n (Bonawitz et al. CCS'17).
    Release threshold t_R (default max(⌊m/2⌋ + 1, 3) for a release with m members: at least
    the minimum cohort 3 of docs/protocol.md §6): a release R is released iff |M_R ∩ U3| >= t_R,
    where U3 is the set of clients whose masked input arrived. Its sum is Σ_{i ∈ M_R ∩ U3} x_{i,R}:
    the release's members that survived. Clients enforce it: they never reveal self-mask shares for
    a release below its threshold (the self-mask seed b_{i,R} is per release, so withholding one
    release keeps its uploads masked while the others are unmasked).

Fixed point: release R is encoded with ``FixedPointCodec.for_bound(bound=B_R, max_summands=m)``
(the most fractional bits with m·B_R·2^f < 2^63), unless ``frac_bits`` is given.

Masking graph. By default every site masks with every other and shares its secrets t-of-n over
the cohort (the full graph). With ``graph`` (:class:`SparseGraph`, SecAgg+) each site masks only
with its k neighbours of a random Harary graph drawn during the round
(:mod:`afl.crypto.secagg.graph`) and shares its secrets t_N-of-(k + 1) among them and itself; the
round threshold t = n - D (D the drop-outs the graph's parameters were chosen for) still applies
to every stage and to the consistency check, and every release must be over the whole cohort
(a release over a subset would see only part of the graph).

Context. ``context`` is opaque bytes the caller binds into the config digest, and so into every
advert and consistency signature (:mod:`afl.crypto.secagg.messages`). The site and the
coordinator set it to the SHA-256 of the exact signed release-plan bytes the round runs under
(:func:`afl.proto.wire.round_config_from_plan`): the plan names the federation, the run and the
digest of the roster the coordinator logged (docs/protocol.md §11a), so a signature made under one
plan (one roster) never verifies under another, even where the two agree on everything this
module checks. The plan's digest rather than the roster digest alone: it binds the roster and
every other signed field of the plan (DP noise, evaluation model, federation) at once, and it is
what sites already sign in their plan decisions. This package never parses it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from afl.crypto.canonical import DOMAIN_TAG, Field, canonical_encode
from afl.crypto.errors import CryptoError, SecAggConfigError
from afl.crypto.fixedpoint import FixedPointCodec
from afl.crypto.kdf import MIN_SALT_BYTES, new_round_salt

__all__ = [
    "MIN_RELEASE_COHORT",
    "ReleaseSpec",
    "RoundConfig",
    "SparseGraph",
    "default_threshold",
]

#: Default minimum number of surviving members of a release (the site's local policy,
#: docs/protocol.md §6).
MIN_RELEASE_COHORT = 3


def default_threshold(n: int) -> int:
    """⌊n/2⌋ + 1: a strict majority of n."""
    return n // 2 + 1


def _check_id(what: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise SecAggConfigError(f"{what} must be a non-empty str, got {value!r}")
    return value


@dataclass(frozen=True)
class ReleaseSpec:
    """One aggregate of the release plan: a flat vector of ``length`` float64 values, |x| <= bound,
    summed over ``members`` (its cohort, a subset of the round's cohort; sorted, unique)."""

    name: str
    members: tuple[str, ...]
    length: int
    bound: float
    threshold: int | None = None
    frac_bits: int | None = None

    def __post_init__(self) -> None:
        _check_id("release name", self.name)
        members = tuple(_check_id("release member", m) for m in self.members)
        if len(set(members)) != len(members):
            raise SecAggConfigError(f"release {self.name!r} lists a member twice")
        object.__setattr__(self, "members", tuple(sorted(members)))
        if isinstance(self.length, bool) or not isinstance(self.length, int) or self.length < 1:
            raise SecAggConfigError(f"release {self.name!r}: length must be an int >= 1")
        m = len(members)
        if self.threshold is not None:
            if not isinstance(self.threshold, int) or not 1 <= self.threshold <= m:
                raise SecAggConfigError(
                    f"release {self.name!r}: threshold must be in 1..{m}, got {self.threshold!r}"
                )
        elif self.min_survivors > m:
            raise SecAggConfigError(
                f"release {self.name!r} has {m} members, fewer than the minimum cohort "
                f"{self.min_survivors}; set an explicit threshold to accept the exposure"
            )
        try:
            self.codec()
        except CryptoError as exc:
            raise SecAggConfigError(f"release {self.name!r}: {exc}") from exc

    @property
    def min_survivors(self) -> int:
        """t_R: the fewest surviving members for which this release is released."""
        if self.threshold is not None:
            return self.threshold
        return max(default_threshold(len(self.members)), MIN_RELEASE_COHORT)

    def codec(self) -> FixedPointCodec:
        """The fixed-point codec of this release (valid for sums of all its members)."""
        k = max(len(self.members), 1)
        if self.frac_bits is None:
            return FixedPointCodec.for_bound(bound=self.bound, max_summands=k)
        return FixedPointCodec(bound=self.bound, frac_bits=self.frac_bits, max_summands=k)

    def fields(self) -> tuple[Field, ...]:
        """Canonical fields of the spec (bound as its float64 hex, exact)."""
        codec = self.codec()
        return (
            self.name,
            len(self.members),
            *self.members,
            self.length,
            float(self.bound).hex(),
            codec.frac_bits,
            self.min_survivors,
        )


@dataclass(frozen=True)
class SparseGraph:
    """The plan's sparse masking graph: degree k, neighbourhood Shamir threshold t_N, and the
    colluders C the parameters were chosen for (the drop-outs D are n - t;
    :mod:`afl.crypto.secagg.graph_bounds`)."""

    degree: int
    share_threshold: int
    colluders: int

    def fields(self) -> tuple[Field, ...]:
        return ("sparse-graph", self.degree, self.share_threshold, self.colluders)


@dataclass(frozen=True)
class RoundConfig:
    """The public, per-round configuration every party holds (the server publishes it signed).

    ``cohort`` is sorted on construction; ``share_index(site)`` = 1 + its position, the x-coordinate
    of the Shamir shares that site holds.
    """

    round_id: str
    round_salt: bytes
    cohort: tuple[str, ...]
    releases: tuple[ReleaseSpec, ...]
    threshold: int | None = None
    graph: SparseGraph | None = None
    #: Opaque bytes bound into :meth:`digest` (module docstring "Context"; empty: none).
    context: bytes = b""

    def __post_init__(self) -> None:
        _check_id("round_id", self.round_id)
        if not isinstance(self.context, bytes):
            raise SecAggConfigError("the config's context must be bytes")
        if not isinstance(self.round_salt, bytes) or len(self.round_salt) < MIN_SALT_BYTES:
            raise SecAggConfigError(f"round_salt must be at least {MIN_SALT_BYTES} random bytes")
        cohort = tuple(_check_id("site id", s) for s in self.cohort)
        if len(set(cohort)) != len(cohort):
            raise SecAggConfigError("the cohort lists a site twice")
        if len(cohort) < 2:
            raise SecAggConfigError("secure aggregation needs a cohort of at least 2 sites")
        object.__setattr__(self, "cohort", tuple(sorted(cohort)))
        object.__setattr__(self, "releases", tuple(self.releases))
        n = len(cohort)
        if self.threshold is not None and (
            isinstance(self.threshold, bool)
            or not isinstance(self.threshold, int)
            or not 2 <= self.threshold <= n
        ):
            raise SecAggConfigError(f"threshold t must be an int in 2..{n}, got {self.threshold!r}")
        if not self.releases:
            raise SecAggConfigError("the release plan is empty")
        names = [r.name for r in self.releases]
        if len(set(names)) != len(names):
            raise SecAggConfigError("two releases share a name")
        for release in self.releases:
            strangers = set(release.members) - set(cohort)
            if strangers:
                raise SecAggConfigError(
                    f"release {release.name!r} has members outside the cohort: {sorted(strangers)}"
                )
        if self.graph is not None:
            self._check_graph(self.graph, n)

    def _check_graph(self, graph: SparseGraph, n: int) -> None:
        k, t_n = graph.degree, graph.share_threshold
        if any(isinstance(v, bool) or not isinstance(v, int) for v in (k, t_n, graph.colluders)):
            raise SecAggConfigError("the sparse graph's parameters must be ints")
        if k % 2 or not 2 <= k <= n - 2:
            raise SecAggConfigError(f"a sparse graph needs an even degree k in 2..{n - 2}, got {k}")
        if not 2 <= t_n <= k:
            raise SecAggConfigError(f"the neighbourhood threshold must lie in 2..{k}, got {t_n}")
        if self.threshold is None or not 0 <= graph.colluders < n:
            raise SecAggConfigError("a sparse graph needs an explicit round threshold t = n - D")
        for release in self.releases:
            if len(release.members) != n:
                raise SecAggConfigError(
                    f"release {release.name!r} is not over the whole cohort; a sparse graph "
                    "masks only releases over every participant (gram_scope = global)"
                )

    @classmethod
    def create(
        cls,
        *,
        round_id: str,
        cohort: Sequence[str],
        releases: Sequence[ReleaseSpec],
        threshold: int | None = None,
        graph: SparseGraph | None = None,
        context: bytes = b"",
    ) -> RoundConfig:
        """A config with a fresh random round salt (:func:`afl.crypto.kdf.new_round_salt`)."""
        return cls(
            round_id=round_id,
            round_salt=new_round_salt(),
            cohort=tuple(cohort),
            releases=tuple(releases),
            threshold=threshold,
            graph=graph,
            context=context,
        )

    @property
    def t(self) -> int:
        """The round threshold t (default ⌊n/2⌋ + 1)."""
        return self.threshold if self.threshold is not None else default_threshold(len(self.cohort))

    @property
    def share_threshold(self) -> int:
        """The Shamir threshold of every secret: t_N with a sparse graph, else t."""
        return self.graph.share_threshold if self.graph is not None else self.t

    @property
    def dropouts(self) -> int:
        """D = n - t: the drop-outs a round tolerates."""
        return len(self.cohort) - self.t

    def share_index(self, site: str) -> int:
        """Shamir x-coordinate of the shares held by ``site`` (1-based cohort position)."""
        try:
            return self.cohort.index(site) + 1
        except ValueError:
            raise SecAggConfigError(f"site {site!r} is not in the cohort") from None

    def release(self, name: str) -> ReleaseSpec:
        """The release named ``name``."""
        for release in self.releases:
            if release.name == name:
                return release
        raise SecAggConfigError(f"no release named {name!r} in the plan")

    def releases_of(self, site: str) -> tuple[ReleaseSpec, ...]:
        """The releases ``site`` takes part in, in plan order."""
        return tuple(r for r in self.releases if site in r.members)

    def digest(self) -> bytes:
        """SHA-256 of the canonical encoding of the whole config, its context included (bound
        into every signature).

        Computed once per config object: it encodes the cohort and every release's members
        (O(K) work), and each party binds it into O(K) adverts and consistency signatures. The
        cache is sound because every field is immutable (a frozen dataclass of str, bytes, ints
        and tuples of frozen specs; ``dataclasses.replace`` makes a new object)."""
        cached: bytes | None = self.__dict__.get("_digest")
        if cached is None:
            cached = self._compute_digest()
            object.__setattr__(self, "_digest", cached)
        return cached

    def _compute_digest(self) -> bytes:
        fields: list[Field] = [
            DOMAIN_TAG,
            "round-config",
            self.round_id,
            self.round_salt,
            self.context,
            self.t,
            len(self.cohort),
            *self.cohort,
            len(self.releases),
        ]
        for release in self.releases:
            fields.append(canonical_encode(release.fields()))
        if self.graph is not None:
            fields.append(canonical_encode(self.graph.fields()))
        return hashlib.sha256(canonical_encode(fields)).digest()
