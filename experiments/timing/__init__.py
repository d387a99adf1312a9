"""The time model: what an emulated step's ops ask of the hardware, priced on a profile and
overlapped as the code runs them (docs/design.md#the-time-model).

    op_costs        the step's work per window: FLOPs, bytes, launches, collectives, copies
    work_fit        the work at paper scale from the fit's samples
    profile         hardware profiles: rates as data, each with its source (profiles/*.json)
    time_model      the work priced on a profile and overlapped as the code runs it
    calibrate       a profile measured on this machine (``upipe-bench calibrate``;
                    calibrate_comm: its collectives)

Imports config, instruments and the harness (calibrate runs real steps); never the emulation
(which imports it), the runner or reporting.
"""
