from echo import passive_openmp

passive_openmp()  # before anything imports torch
