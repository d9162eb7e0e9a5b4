"""`python -m megamoe_trainer RECIPE.yaml [options]`: the same as `megamoe-train`."""

if __name__ == "__main__":  # not when multiprocessing's spawn re-imports the parent's main module
    from .cli import main

    raise SystemExit(main())
