"""The float64 judges that ``tools/fidelity.py`` runs: ``grad``, ``step``, ``drift``, ``drq`` (one
module each, with ``main(argv)``), and ``common``, what they share."""
