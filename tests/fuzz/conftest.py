"""Hypothesis profiles for the fuzz suite.

The default run keeps each fuzz test to a few seconds (the examples per test are set in the test
files through ``examples``); ``pytest tests/fuzz --hypothesis-profile=long`` runs 25 times as many.
(The profile must be registered before pytest configures hypothesis: name ``tests/fuzz`` on the
command line, as above, so this conftest is loaded first.)
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings

LONG_FACTOR = 25

settings.register_profile(
    "long",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)


def examples(n: int) -> settings:
    """Settings for a fuzz test: ``n`` examples by default, ``LONG_FACTOR * n`` under the ``long`` profile."""
    scale = LONG_FACTOR if settings.get_current_profile_name() == "long" else 1
    return settings(
        max_examples=n * scale,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )
