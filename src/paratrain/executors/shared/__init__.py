"""Parts several executors run (ZeRO, the replicas' compressor and row check), on a floor
below them: the executors do not import each other (import-linter's ``executors`` contract).
"""
