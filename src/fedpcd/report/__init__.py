"""``fedpcd report``: tables and plots from finished run directories, by job.

``read`` loads the runs (config, records, summary; duplicates refused), ``groups`` groups seeds of one
setting and pairs runs with a reference algorithm's, ``stats`` computes a cell's numbers, ``tables`` writes
the markdown table, ``figures`` the plots, ``grid`` and ``paper`` the papers' methods x settings layout,
``verdict`` the paired t-test scale, ``geometry`` the class-mean angles of FedGELA's Fig. 3 (torch and the
data: imported only by ``--geometry``), and ``document`` puts them together as ``fedpcd report`` prints and
writes them. Importers use the submodules.
"""
