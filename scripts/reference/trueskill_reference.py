#!/usr/bin/env python3
"""Reference TrueSkill values for src/evaluate/trueskill.rs.

Produced with the reference package `trueskill` 0.4.5 (PyPI), default
environment (mu=25, sigma=25/3, beta=sigma/2, tau=sigma/100, draw_probability=0.10):

    python3 -m venv target/tsvenv
    target/tsvenv/bin/pip install trueskill==0.4.5
    target/tsvenv/bin/python scripts/reference/trueskill_reference.py

Each line is a Rust tuple literal pasted into the tests of trueskill.rs:
(mu_a, sigma_a, mu_b, sigma_b, drawn, mu_a', sigma_a', mu_b', sigma_b').
Player a is the winner unless drawn.

Then the multi-player rankings (one free-for-all per line, lower rank is
better, equal ranks draw): (&[(mu, sigma), ...], &[rank, ...], &[(mu', sigma'), ...]).
"""
import trueskill

env = trueskill.TrueSkill()  # the package defaults are E-SPL's parameters
assert abs(env.beta - 25 / 6) < 1e-12 and abs(env.tau - 25 / 300) < 1e-12
assert env.draw_probability == 0.10

CASES = [
    (25.0, 25 / 3, 25.0, 25 / 3, False),
    (25.0, 25 / 3, 25.0, 25 / 3, True),
    (30.0, 4.0, 20.0, 6.0, False),  # favourite wins
    (20.0, 6.0, 30.0, 4.0, False),  # upset
    (30.0, 4.0, 20.0, 6.0, True),   # draw between unequal players
    (20.0, 6.0, 30.0, 4.0, True),
    (27.5, 1.2, 26.0, 1.5, False),  # well-known players
    (25.0, 25 / 3, 35.0, 1.0, False),  # a newcomer beats an established one
    (10.0, 3.0, 40.0, 3.0, False),  # extreme upset
]

for mu_a, s_a, mu_b, s_b, drawn in CASES:
    a, b = env.create_rating(mu_a, s_a), env.create_rating(mu_b, s_b)
    (a2,), (b2,) = env.rate([(a,), (b,)], ranks=[0, 0] if drawn else [0, 1])
    print(
        f"({mu_a!r}, {s_a!r}, {mu_b!r}, {s_b!r}, {str(drawn).lower()}, "
        f"{a2.mu!r}, {a2.sigma!r}, {b2.mu!r}, {b2.sigma!r}),"
    )

print()
RANKINGS = [
    ([(25.0, 25 / 3)] * 3, [0, 1, 2]),
    ([(25.0, 25 / 3)] * 4, [0, 1, 2, 3]),
    ([(25.0, 25 / 3)] * 4, [1, 0, 1, 2]),  # a tie in the middle, given out of order
    ([(30.0, 2.0), (25.0, 25 / 3), (26.0, 1.0), (22.0, 4.0)], [3, 0, 1, 2]),
    ([(27.0, 3.0), (29.0, 5.24), (25.0, 8.0), (25.0, 8.0), (25.0, 8.0)], [0, 0, 1, 2, 2]),
]
for ratings, ranks in RANKINGS:
    groups = [(env.create_rating(mu, s),) for mu, s in ratings]
    out = env.rate(groups, ranks=ranks)
    rs = ", ".join(f"({mu!r}, {s!r})" for mu, s in ratings)
    os_ = ", ".join(f"({g[0].mu!r}, {g[0].sigma!r})" for g in out)
    print(f"(&[{rs}], &{ranks}, &[{os_}]),")
