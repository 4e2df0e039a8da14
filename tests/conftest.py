"""Test-suite settings shared by every test module."""

from hypothesis import HealthCheck, settings

# Deterministic property tests: the same examples on every run and every machine,
# so CI never fails by chance; no per-example deadline (shared CI machines are noisy).
settings.register_profile(
    "reference",
    derandomize=True,
    deadline=None,
    max_examples=60,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("reference")
