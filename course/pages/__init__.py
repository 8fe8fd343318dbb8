"""The pages: self-contained HTML files drawn from runs of the module's own code.

    trace.py            `trace`: one recorded engine run, step by step (the recorder, the page)
    trace_workloads.py  the trace's workloads, and the replay of a `loadtest --save-workload` file
    trace_page/         the trace page's HTML, CSS and script (package data, inlined when written)
    report/             `report`: the lab's mechanisms as figures, one module per figure
    fleet_page.py       `fleet --html`: goodput against offered rate, the pick and the runner-up
    svg.py              the drawing the report and the fleet page share: SVG elements, axes, one page
"""
