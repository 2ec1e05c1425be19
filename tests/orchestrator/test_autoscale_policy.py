"""The dynamic P:D controller (`driver.autoscale`) by table: a cluster state per row, and its move."""

from __future__ import annotations

import math

import pytest

from pdcluster.driver.autoscale import (
    Capacity,
    InstanceView,
    Move,
    Policy,
    Signals,
    SignalWindow,
    arrival_demand,
    decide,
    p90,
    pool_demand,
)

# one prefill instance computes 1000 prompt tokens/s; one decode instance holds 10 requests within TPOT
CAP = Capacity(prefill_tokens_per_s=1000.0, decode_batch=10.0)
POLICY = Policy(ttft_slo_s=1.0, tpot_slo_s=0.1, dwell_s=30.0, hysteresis=0.15, drain_timeout_s=20.0)
NOW = 100.0
LONG_DRAIN = Policy(ttft_slo_s=1.0, tpot_slo_s=0.1, drain_timeout_s=60.0)


def P(i, queued=0, **kw):  # noqa: N802
    return InstanceView(i, "prefill", queued_tokens=queued, **kw)


def D(i, batch=0, **kw):  # noqa: N802
    return InstanceView(i, "decode", batch=batch, **kw)


def PK(i, **kw):  # noqa: N802
    return InstanceView(i, "parked", **kw)


CASES = [
    # (id, instances, signals, policy, expected (instance, source, target) or None)
    ("idle 2P2D: nothing", [P(0), P(1), D(2), D(3)], Signals(0.0), POLICY, None),
    # prefill demand 3.6 on 2 (1.8), decode 0.2 on 2: move the decode with the smaller batch
    ("prompt-heavy: D->P", [P(0), P(1), D(2, 1), D(3, 3)], Signals(3600.0), POLICY, (2, "decode", "prefill")),
    # decode demand 3.5 on 2 (1.75), prefill 0.2 on 2: move the prefill with the shorter queue
    (
        "output-heavy: P->D",
        [P(0, 50), P(1, 0), D(2, 18), D(3, 17)],
        Signals(200.0),
        POLICY,
        (1, "prefill", "decode"),
    ),
    # both pools busy alike: a move makes the other one worse
    ("balanced: nothing", [P(0), P(1), D(2, 9), D(3, 9)], Signals(1800.0), POLICY, None),
    # u_p 0.9, u_d 0.7: a move gives max(1.8/3, 1.4/1)=1.4 > 0.9 - 0.15
    ("move would hurt donor", [P(0), P(1), D(2, 7), D(3, 7)], Signals(1800.0), POLICY, None),
    # the last move (to decode) 20 s ago: u_p 0.9 waits for the dwell (arrivals 1.8 < 2 instances)
    (
        "last move within dwell",
        [P(0), P(1), D(2, 1), D(3, 1, last_move_s=80.0)],
        Signals(1800.0),
        POLICY,
        None,
    ),
    # prefill's arrivals alone (3.6) overload its 2 instances: the reversal does not wait
    (
        "reversal within dwell to an overloaded pool",
        [P(0), P(1), D(2, 1), D(3, 1, last_move_s=80.0)],
        Signals(3600.0),
        POLICY,
        (2, "decode", "prefill"),
    ),
    # the last move (to prefill) 2 s ago: continuing it is no reversal
    (
        "same direction within dwell",
        [P(0), P(1, last_move_s=98.0), D(2, 1), D(3, 1), D(4, 1)],
        Signals(4800.0),
        POLICY,
        (2, "decode", "prefill"),
    ),
    (
        "park within dwell",
        [P(0), P(1), D(2), D(3, last_move_s=98.0)],
        Signals(10.0),
        Policy(1.0, 0.1, park=True),
        None,
    ),
    # the dwell passed; the decode that drains fastest goes, not the emptiest
    (
        "cheapest drain first",
        [P(0), P(1, last_move_s=60.0), D(2, 0, drain_s=5.0), D(3, 1, drain_s=1.0), D(4, 1, drain_s=2.0)],
        Signals(3600.0),
        POLICY,
        (3, "decode", "prefill"),
    ),
    ("a move in progress", [P(0), P(1, available=False), D(2, 1), D(3, 1)], Signals(3600.0), POLICY, None),
    # 10P10D, u_p 1.2 and u_d 0.4: one move alone lowers the peak 0.11 (< hysteresis), 5 of them to 0.8
    (
        "many instances: the reachable split counts",
        [*[P(i) for i in range(10)], *[D(i, 4) for i in range(10, 20)]],
        Signals(12000.0),
        POLICY,
        (10, "decode", "prefill"),
    ),
    # one of two allowed moves under way (to prefill, counted there: 3 vs demand 3.6): a second continues it
    (
        "a second move in flight",
        [P(0), P(1), D(2, 1, available=False, moving_to="prefill"), D(3, 1), D(4, 1), D(5, 1)],
        Signals(3600.0),
        Policy(1.0, 0.1, max_moves_in_flight=2),
        (3, "decode", "prefill"),
    ),
    (
        "moves in flight at the limit",
        [P(0), P(1), D(2, 1, available=False, moving_to="prefill"), D(3, 1), D(4, 1), D(5, 1)],
        Signals(3600.0),
        Policy(1.0, 0.1, max_moves_in_flight=1),
        None,
    ),
    # a move to decode under way: the prefill pool's need waits for it (no reversal while in flight)
    (
        "no reversal in flight",
        [P(0), P(1), P(2, available=False, moving_to="decode"), D(3, 1), D(4, 1)],
        Signals(3600.0),
        Policy(1.0, 0.1, max_moves_in_flight=2),
        None,
    ),
    ("decode at its min bound", [P(0), P(1), D(2, 1)], Signals(3600.0), POLICY, None),
    (
        "prefill at its max bound",
        [P(0), P(1), D(2, 1), D(3, 1)],
        Signals(3600.0),
        Policy(ttft_slo_s=1.0, tpot_slo_s=0.1, prefill_bounds=(1, 2)),
        None,
    ),
    # every decode drains longer than the bound
    (
        "drain over the bound",
        [P(0), P(1), D(2, 1, drain_s=25.0), D(3, 1, drain_s=30.0)],
        Signals(3600.0),
        POLICY,
        None,
    ),
    # the move's cost: u_p 1.2, u_d 0.4 -> 0.8 and 0.53; a 28 s drain leaves 2 s of the 30 s dwell to gain
    # 0.4 each, the decode pool runs 0.13 higher for 28 s meanwhile
    (
        "cost over gain",
        [P(0), P(1), *[D(i, 4, drain_s=28.0) for i in (2, 3, 4, 5)]],
        Signals(2400.0),
        LONG_DRAIN,
        None,
    ),
    (
        "cost under gain",
        [P(0), P(1), *[D(i, 4, drain_s=1.0 if i == 5 else 28.0) for i in (2, 3, 4, 5)]],
        Signals(2400.0),
        LONG_DRAIN,
        (5, "decode", "prefill"),
    ),
    # measured prefill busy time beats a low arrival rate: 1.8 busy on 2 -> 0.9
    (
        "prefill busy",
        [P(0, busy_fraction=0.9), P(1, busy_fraction=0.9), D(2, 1), D(3, 1)],
        Signals(100.0),
        POLICY,
        (2, "decode", "prefill"),
    ),
    # both overloaded (u_d 1.5, u_p after 1.3): the move would only shift the backlog
    (
        "both hot",
        [P(0, busy_fraction=0.65), P(1, busy_fraction=0.65), D(2, 15), D(3, 15)],
        Signals(100.0),
        POLICY,
        None,
    ),
    # prefill 10x over, decode's 2.8 on 1 after (< 10 / HOT_DONOR_RATIO): worth it
    ("much hotter", [P(0, 9000), D(1, 14), D(2, 14)], Signals(1000.0), POLICY, (1, "decode", "prefill")),
    ("window not full", [P(0), P(1), D(2, 1), D(3, 3)], Signals(3600.0, window_full=False), POLICY, None),
    # TTFT over its SLO doubles prefill demand (1.2 -> 2.4 on 2 = 1.2 >= 0.8): D->P
    (
        "TTFT over SLO",
        [P(0), P(1), D(2, 1), D(3, 1)],
        Signals(1200.0, ttft_p90_s=3.0),
        POLICY,
        (2, "decode", "prefill"),
    ),
    # the same without the SLO miss: u_p 0.6 < 0.8
    ("TTFT within SLO", [P(0), P(1), D(2, 1), D(3, 1)], Signals(1200.0, ttft_p90_s=0.5), POLICY, None),
    # KV occupancy 0.95 on 1 decode: demand 1.06 > batch demand
    (
        "KV full: P->D",
        [P(0), P(1), P(2), D(3, 2)],
        Signals(100.0, kv_occupancy=0.95),
        POLICY,
        (0, "prefill", "decode"),
    ),
    ("parking off", [P(0), P(1), D(2), D(3)], Signals(10.0), POLICY, None),
    # the idler pool (decode, demand 0) parks first
    (
        "park at low load",
        [P(0), P(1), D(2), D(3)],
        Signals(10.0),
        Policy(1.0, 0.1, park=True),
        (2, "decode", "parked"),
    ),
    (
        "park prefill",
        [P(0), P(1), D(2, 2)],
        Signals(10.0),
        Policy(1.0, 0.1, park=True),
        (0, "prefill", "parked"),
    ),
    ("park keeps the min", [P(0), D(1)], Signals(10.0), Policy(1.0, 0.1, park=True), None),
    ("unpark as load rises", [P(0), PK(1), D(2, 1)], Signals(900.0), POLICY, (1, "parked", "prefill")),
    # unparking ignores the dwell: the SLO comes first
    (
        "unpark within dwell",
        [P(0, last_move_s=99.0), PK(1), D(2, 9)],
        Signals(100.0),
        POLICY,
        (1, "parked", "decode"),
    ),
    ("parked stay at low load", [P(0), PK(1), D(2, 1)], Signals(100.0), POLICY, None),
]


@pytest.mark.parametrize(
    ("instances", "signals", "policy", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_decide(instances, signals, policy, expected):
    move = decide(NOW, instances, signals, CAP, policy)
    if expected is None:
        assert move is None
    else:
        assert isinstance(move, Move)
        assert (move.instance_id, move.source, move.target) == expected
        assert move.reason  # the log says why


# the forecast: one decode instance also emits 200 output tokens/s; H = the TTFT SLO, 1 s
CAP_F = Capacity(prefill_tokens_per_s=1000.0, decode_batch=10.0, decode_tokens_per_s=200.0)
FORECAST = Policy(ttft_slo_s=1.0, tpot_slo_s=0.1, dwell_s=1.0, drain_timeout_s=20.0)
BURST = [P(0, 600, queued_output_tokens=120), P(1, 600, queued_output_tokens=120), D(2, 1), D(3, 1)]
SHORT = [P(0, 600, queued_output_tokens=10), P(1, 600, queued_output_tokens=10), D(2, 1), D(3, 1)]
FORECAST_CASES = [
    # (id, instances, signals, capacity, expected)
    # 600 output tokens/s arriving: decode 3.0 on 2 before its batch grows; prefill 0.2 on 2
    (
        "output-heavy arrivals: P->D ahead",
        [P(0), P(1), D(2, 1), D(3, 1)],
        Signals(200.0, decode_tokens_per_s=600.0),
        CAP_F,
        (0, "prefill", "decode"),
    ),
    (
        "same window, no forecast",
        [P(0), P(1), D(2, 1), D(3, 1)],
        Signals(200.0, decode_tokens_per_s=600.0),
        CAP,
        None,
    ),
    # a prompt burst that becomes decode load: prefill 1.0 + 1200/1000 = 2.2, decode 1.0 + 240/200 = 2.2
    (
        "prompt burst to become decode load: no over-moving",
        BURST,
        Signals(1000.0, decode_tokens_per_s=200.0),
        CAP_F,
        None,
    ),
    (
        "same burst, decode seen by its batch only: D->P",
        BURST,
        Signals(1000.0, decode_tokens_per_s=200.0),
        CAP,
        (2, "decode", "prefill"),
    ),
    # the same burst with short outputs: decode max(0.2, 0.1) + 20/200 = 0.3, prefill 2.2
    (
        "prompt burst of short outputs: D->P",
        SHORT,
        Signals(1000.0, decode_tokens_per_s=20.0),
        CAP_F,
        (2, "decode", "prefill"),
    ),
    # output-heavy load falling away (a phase of long outputs ending): prefill 2000/1000 = 2.0 on 1; decode
    # max(15/10, 500/200) = 2.5 on 3. The donor is judged by its held batch, 1.5 / 2 = 0.75 <= 0.8 after a
    # move (the forecast's 2.5 / 2 = 1.25 lags the window): D->P, max(1.25, 1.0) <= 2.0 - 0.15
    (
        "forecast lagging a falling output load: D->P",
        [P(0), D(1, 5), D(2, 5), D(3, 5)],
        Signals(2000.0, decode_tokens_per_s=500.0),
        CAP_F,
        (1, "decode", "prefill"),
    ),
    # the same with a held batch of 18: 1.8 / 2 = 0.9 > 0.8 after a move, and 2.0 < 3 x 0.9
    (
        "same, the donor's held batch hot: no move",
        [P(0), D(1, 6), D(2, 6), D(3, 6)],
        Signals(2000.0, decode_tokens_per_s=500.0),
        CAP_F,
        None,
    ),
    (
        "forecast within capacity",
        [P(0), P(1), D(2, 1), D(3, 1)],
        Signals(800.0, decode_tokens_per_s=160.0),
        CAP_F,
        None,
    ),
]


@pytest.mark.parametrize(
    ("instances", "signals", "capacity", "expected"),
    [c[1:] for c in FORECAST_CASES],
    ids=[c[0] for c in FORECAST_CASES],
)
def test_decide_with_the_decode_forecast(instances, signals, capacity, expected):
    move = decide(NOW, instances, signals, capacity, FORECAST)
    got = None if move is None else (move.instance_id, move.source, move.target)
    assert got == expected, move


def test_a_backlog_does_not_make_the_donor_hot():
    # prefill: 1.5 s of queued work each (over the TTFT SLO: busy measures it): demand
    # max(0.6 + 4500/1000, 3.0) = 5.1 on 3 (2.55 on 2 after a move), its arrivals 0.6 (0.3 on 2);
    # decode 1200/200 = 6.0 on 2 (3.0) takes one: max(2.55, 2.0) < 3.0 - hysteresis
    instances = [P(i, 1500, busy_fraction=1.0) for i in range(3)] + [D(3, 1), D(4, 1)]
    move = decide(NOW, instances, Signals(600.0, decode_tokens_per_s=1200.0), CAP_F, FORECAST)
    assert move is not None and (move.instance_id, move.source, move.target) == (0, "prefill", "decode")


def test_forecast_demand_formula():
    instances = [P(0, 500, queued_output_tokens=100, busy_fraction=0.9), D(1, 5), D(2, 10)]
    signals = Signals(2000.0, kv_occupancy=0.45, decode_tokens_per_s=400.0)
    # prefill: max(2000/1000, 0.9) + 500/(1000*1); decode: max(15/10, 0.45*2/0.9, 400/200) + 100/(200*1)
    assert pool_demand(instances, signals, CAP_F, FORECAST) == {"prefill": 2.5, "decode": 2.5}
    assert arrival_demand(instances, signals, CAP_F, FORECAST) == {"prefill": 2.0, "decode": 2.0}
    # a donor's own load: no forecast term, decode max(15/10, 0.45*2/0.9)
    held = arrival_demand(instances, signals, CAP_F, FORECAST, forecast=False)
    assert held == {"prefill": 2.0, "decode": 1.5}
    # a queue over one TTFT SLO: the busy fraction measures it, not arrivals
    busy = [P(0, 1500, busy_fraction=1.0), D(1)]
    assert arrival_demand(busy, Signals(100.0), CAP_F, FORECAST)["prefill"] == 0.1
    assert (
        arrival_demand([P(0, 500, busy_fraction=1.0), D(1)], Signals(100.0), CAP_F, FORECAST)["prefill"]
        == 1.0
    )


def test_pool_demand_formula():
    instances = [P(0, 500), D(1, 5), D(2, 10)]
    demand = pool_demand(instances, Signals(2000.0, kv_occupancy=0.45), CAP, POLICY)
    # prefill: 2000/1000 + 500/(1000*1.0); decode: max(15/10, 0.45*2/0.9)
    assert demand == {"prefill": 2.5, "decode": 1.5}
    demand = pool_demand(instances, Signals(2000.0, tpot_p90_s=0.5), CAP, POLICY)
    assert demand["decode"] == 1.5 * 2.0  # capped at SLO_PRESSURE_CAP


def test_bad_inputs():
    with pytest.raises(ValueError, match="duplicate instance ids"):
        decide(NOW, [P(0), D(0)], Signals(0.0), CAP, POLICY)
    with pytest.raises(ValueError, match="unknown role 'other'"):
        decide(NOW, [P(0), InstanceView(1, "other")], Signals(0.0), CAP, POLICY)
    with pytest.raises(ValueError, match="must be > 0"):
        Capacity(0.0, 1.0)
    with pytest.raises(ValueError, match="window_s must be > 0"):
        SignalWindow(0.0)


def test_signal_window():
    window = SignalWindow(10.0)
    window.add_prompt(0.0, 100, 40)
    window.add_prompt(2.0, 300)
    # 4 s since the first sample: 400 tokens / 4 s, 40 expected output tokens / 4 s
    assert window.signals(4.0, 0.5) == Signals(100.0, 0.5, None, None, False, decode_tokens_per_s=10.0)
    for t, v in enumerate([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]):
        window.add_ttft(5.0 + t * 0.1, v)
    window.add_tpot(6.0, 0.05)
    got = window.signals(11.0, 0.0)  # the prompt at 0.0 left the window
    assert got.prefill_tokens_per_s == 300 / 10.0
    assert got.ttft_p90_s == 0.9 and got.tpot_p90_s == 0.05
    assert window.signals(30.0, 0.0) == Signals(0.0, 0.0, None, None)
    assert window.mean_prompt_tokens() is None
    assert p90([]) is None and p90([3.0]) == 3.0
    assert math.isinf(InstanceView(0, "prefill").last_move_s)
