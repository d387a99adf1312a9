"""Reading results: tables, plots, notebook helpers and the results index
(docs/design.md#layout-and-dependency-direction).

    tables          rows.csv and max_context.csv rebuilt from a sweep's run files
    plots           the figures, a pure function of the tables
    notebook        what the notebooks share: finding results/, reading tables, labels
    results_index   the generated provenance index in results/README.md
    readme_headline the README's generated headline table (max context, tokens/s, the paper's)
    sections        generated sections of a markdown file, between two markers

Reads result files only (``experiments.store``); imports no harness, emulation or runner code,
and the harness imports none of this.
"""
