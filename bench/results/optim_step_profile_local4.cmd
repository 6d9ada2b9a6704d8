python bench/optim_step_profile.py --methods onebit_adam,onebit_lamb,zeroone_adam --steps 12 --profiled 4
