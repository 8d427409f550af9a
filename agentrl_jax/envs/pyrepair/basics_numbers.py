"""Basic problems on numbers: arithmetic, digits, divisibility, conditionals (see ``basics``)."""

from agentrl_jax.envs.pyrepair.basics_entry import Basic, inputs


@inputs(1, 2, 0, 7, -3, -4, 10)
def is_even(n):
    """Return True if the integer n is even, else False."""
    return n % 2 == 0


@inputs((5, 3), (3, 5), (4, 4), (-2, 3), (0, -7), (10, 1))
def absolute_difference(a, b):
    """Return the absolute value of a minus b."""
    if a > b:
        return a - b
    return b - a


@inputs(-5, 0, 1, 5, -1, 100, -42)
def sign(n):
    """Return 1 if n is positive, -1 if n is negative and 0 if n is zero."""
    if n > 0:
        return 1
    if n < 0:
        return -1
    return 0


@inputs((2, 3, 1), (1, 2, 3), (3, 2, 1), (1, 3, 2), (5, 5, 1), (-1, -2, -3), (0, -2, -1), (4, 0, 4))
def largest_of_three(a, b, c):
    """Return the largest of the three numbers a, b and c."""
    largest = a
    if b > largest:
        largest = b
    if c > largest:
        largest = c
    return largest


@inputs((15, 0, 10), (-3, 0, 10), (5, 0, 10), (0, 0, 10), (10, 0, 10), (11, 0, 10), (-5, -10, -1))
def clamp(x, low, high):
    """Return x limited to the range from low to high inclusive."""
    if x < low:
        return low
    if x > high:
        return high
    return x


@inputs(3, 0, 1, 2, 5, 6)
def factorial(n):
    """Return n factorial, the product of the integers 1 to n (factorial(0) is 1)."""
    result = 1
    for i in range(1, n + 1):
        result *= i
    return result


@inputs((2, 3), (2, 0), (2, 1), (3, 2), (5, 3), (-2, 3), (0, 0), (1, 5))
def power(base, exponent):
    """Return base raised to the non-negative integer exponent, by repeated multiplication."""
    result = 1
    for _ in range(exponent):
        result *= base
    return result


@inputs(100, 99, -450, 0, 5, 9, 10, 12345, -7)
def count_digits(n):
    """Return the number of decimal digits of the integer n, ignoring its sign (1 for 0)."""
    n = abs(n)
    count = 1
    while n >= 10:
        n //= 10
        count += 1
    return count


@inputs(123, 0, 7, 10, 9999, 505, 1000001)
def sum_of_digits(n):
    """Return the sum of the decimal digits of the non-negative integer n."""
    total = 0
    while n > 0:
        total += n % 10
        n //= 10
    return total


@inputs(120, 0, 7, 12, 1234, 1000, 505)
def reverse_number(n):
    """Return the integer whose decimal digits are those of n >= 0 reversed (120 -> 21)."""
    result = 0
    while n > 0:
        result = result * 10 + n % 10
        n //= 10
    return result


@inputs((18, 12), (12, 18), (7, 5), (0, 5), (5, 0), (0, 0), (100, 75), (17, 17))
def greatest_common_divisor(a, b):
    """Return the greatest common divisor of the non-negative integers a and b (0 for 0 and 0)."""
    while b != 0:
        a, b = b, a % b
    return a


@inputs((2, 5), (4, 6), (6, 4), (3, 5), (7, 7), (1, 9), (12, 18), (2, 8))
def least_common_multiple(a, b):
    """Return the smallest positive integer divisible by both positive integers a and b."""
    m = max(a, b)
    while m % a != 0 or m % b != 0:
        m += 1
    return m


@inputs(3, 4, 1, 0, 2, 9, 13, 25, 29, -7)
def is_prime(n):
    """Return True if n is a prime number, else False (numbers below 2 are not prime)."""
    if n < 2:
        return False
    for d in range(2, n):
        if n % d == 0:
            return False
    return True


@inputs(6, 1, 2, 12, 7, 16, 30)
def count_divisors(n):
    """Return how many positive integers divide the positive integer n exactly."""
    count = 0
    for d in range(1, n + 1):
        if n % d == 0:
            count += 1
    return count


@inputs(12, 2, 1, 6, 28, 7, 9)
def sum_proper_divisors(n):
    """Return the sum of the positive divisors of the positive integer n that are less than n."""
    total = 0
    for d in range(1, n):
        if n % d == 0:
            total += d
    return total


@inputs(1, 3, 15, 5, 30, 9, 10, 7, 0)
def fizzbuzz(n):
    """Return 'FizzBuzz' if n is divisible by 15, 'Fizz' if by 3, 'Buzz' if by 5, else str(n)."""
    if n % 15 == 0:
        return "FizzBuzz"
    if n % 3 == 0:
        return "Fizz"
    return "Buzz" if n % 5 == 0 else str(n)


@inputs(79, 90, 80, 95, 89, 70, 69, 0, 100)
def letter_grade(score):
    """Return 'A' for a score of 90 or more, 'B' for 80 to 89, 'C' for 70 to 79, else 'F'."""
    if score >= 90:
        return "A"
    if score >= 80:
        return "B"
    return "C" if score >= 70 else "F"


@inputs(2000, 1900, 2024, 2023, 2100, 2400, 1996, 1)
def is_leap_year(year):
    """Return True if year is divisible by 4, except century years not divisible by 400."""
    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)


@inputs(3600, 59, 0, 60, 61, 125, 3599)
def split_seconds(seconds):
    """Return the tuple (minutes, seconds) of whole minutes and leftover seconds in seconds."""
    return (seconds // 60, seconds % 60)


@inputs(600, 10, 1439, 0, 9, 59, 60, 61, 69, 125)
def clock_time(minutes):
    """Return the time minutes after midnight as 'H:MM', the hour unpadded ('1:05')."""
    hours = minutes // 60
    mins = minutes % 60
    if mins < 10:
        return str(hours) + ":0" + str(mins)
    return str(hours) + ":" + str(mins)


@inputs((3, 3, 4), (3, 4, 5), (4, 3, 3), (3, 3, 3), (3, 4, 3), (5, 4, 3), (1, 2, 2), (2, 2, 1))
def triangle_kind(a, b, c):
    """Return 'equilateral' if a, b, c are all equal, 'isosceles' if two are, else 'scalene'."""
    if a == b and b == c:
        return "equilateral"
    if a == b or b == c or a == c:
        return "isosceles"
    return "scalene"


@inputs((5, 4, 2), (5, 1, 6), (3, 2, 1), (3, 4, 5), (2, 2, 2), (1, 1, 2), (3, 4, 1), (5, 3, 6))
def is_valid_triangle(a, b, c):
    """Return True if each of the lengths a, b, c is less than the sum of the other two."""
    return a + b > c and a + c > b and b + c > a


@inputs(10, 0, 1, 4, 6, 16, 20)
def sum_of_multiples(n):
    """Return the sum of the non-negative integers below n that are divisible by 3 or 5."""
    total = 0
    for i in range(n):
        if i % 3 == 0 or i % 5 == 0:
            total += i
    return total


@inputs(3, 1, 2, 6, 7, 27)
def collatz_steps(n):
    """Return how many steps of 'halve n if even, else make it 3n + 1' take n > 0 to 1."""
    steps = 0
    while n != 1:
        n = n // 2 if n % 2 == 0 else 3 * n + 1
        steps += 1
    return steps


@inputs(7, 0, 1, 2, 3, 8, 255, 1023, 10)
def count_set_bits(n):
    """Return the number of 1 bits in the binary representation of the non-negative n."""
    count = 0
    while n > 0:
        count += n % 2
        n //= 2
    return count


@inputs(2, 0, 1, 5, 8, 10, 255)
def to_binary(n):
    """Return the binary digits of the non-negative integer n as a string ('0' for 0)."""
    digits = ""
    while n > 0:
        digits = str(n % 2) + digits
        n //= 2
    return digits or "0"


@inputs(13, 3, 65, 0, 2, 12, 64, 80, 30)
def ticket_price(age):
    """Return the ticket price for age: 0 below 3, 5 up to 12, 12 up to 64, else 8."""
    if age < 3:
        return 0
    if age <= 12:
        return 5
    return 12 if age < 65 else 8


@inputs(
    (2, False), (4, False), (7, True), (1, False), (2, True), (6, True), (9, False), (11, False)
)
def days_in_month(month, leap):
    """Return the days in month 1-12; February has 29 if leap is True, else 28."""
    if month == 2:
        return 29 if leap else 28
    if month in (4, 6, 9, 11):
        return 30
    return 31


@inputs((14, 5), (10, 5), (11, 5), (1, 3), (3, 3), (7, 1), (20, 6))
def next_multiple(n, k):
    """Return the smallest multiple of k that is greater than or equal to n (n, k > 0)."""
    while n % k != 0:
        n += 1
    return n


@inputs(14, 5, 0, 4, 15, 16, 99, -4, -5, -6)
def round_to_ten(n):
    """Return the integer n rounded to the nearest multiple of 10, halves rounded up (15 -> 20)."""
    return (n + 5) // 10 * 10


@inputs((7, 8), (1, 3), (1, 2), (0, 5), (5, 5), (2, 3), (3, 200))
def percentage(part, whole):
    """Return part as a percentage of whole, rounded down to an integer (1, 3 -> 33)."""
    return part * 100 // whole


@inputs(2, 0, 1, 3, 4, 6, 8, 12, 1024, -2)
def is_power_of_two(n):
    """Return True if n is a power of two (1, 2, 4, 8, ...), else False."""
    if n < 1:
        return False
    while n % 2 == 0:
        n //= 2
    return n == 1


@inputs(10, 0, 1, 2, 3, 5, 15)
def fibonacci(n):
    """Return the n-th Fibonacci number, where fibonacci(0) is 0 and fibonacci(1) is 1."""
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


@inputs(5, 0, 1, 2, 6, 9, 10)
def sum_of_odds(n):
    """Return the sum of the odd numbers from 1 up to and including n."""
    return sum(range(1, n + 1, 2))


@inputs(9, 0, 1, 2, 4, 8, 15, 16, 26, 49)
def is_perfect_square(n):
    """Return True if the non-negative integer n is the square of an integer."""
    root = 0
    while root * root < n:
        root += 1
    return root * root == n


@inputs((1, 2), (2, 1), (3, 3), (-1, 0), (0, -1), (0, 0))
def compare(a, b):
    """Return 'greater' if a is greater than b, 'less' if a is less than b, else 'equal'."""
    if a > b:
        return "greater"
    if a < b:
        return "less"
    return "equal"


@inputs(24, 30, 0, 1, 4, 5, 9, 10, 25, 41)
def count_coins(amount):
    """Return the fewest coins worth 25, 10, 5 and 1 that add up to the non-negative amount."""
    count = 0
    for coin in [25, 10, 5, 1]:
        count += amount // coin
        amount %= coin
    return count


@inputs(999, 1, 9, 10, 23, 111, 1234, 505)
def product_of_digits(n):
    """Return the product of the decimal digits of the positive integer n."""
    product = 1
    while n > 0:
        product *= n % 10
        n //= 10
    return product


@inputs(11, 0, 7, 12, 121, 123, 1221, 10)
def is_palindrome_number(n):
    """Return True if the decimal digits of the non-negative n read the same both ways."""
    return str(n) == str(n)[::-1]


@inputs(1234, 10, 0, 5, 19, 91, 505, 7071)
def largest_digit(n):
    """Return the largest decimal digit of the non-negative integer n."""
    largest = 0
    while n > 0:
        largest = max(largest, n % 10)
        n //= 10
    return largest


@inputs((1, 2, 3, 4), (3, 4, 0, 0), (0, 0, 0, 0), (-1, 5, 2, -3), (5, 1, 1, 5), (2, 7, 2, 9))
def manhattan_distance(x1, y1, x2, y2):
    """Return the distance |x1 - x2| + |y1 - y2| between the points (x1, y1) and (x2, y2)."""
    return abs(x1 - x2) + abs(y1 - y2)


@inputs((2, 1), (1, 2), (-3, 3), (-1, 2), (3, -2), (3, -3), (0, 5), (4, 4), (-4, -5))
def closest_to_zero(a, b):
    """Return whichever of a and b is closer to zero, the larger one if they are equally close."""
    if abs(a) < abs(b):
        return a
    if abs(b) < abs(a):
        return b
    return max(a, b)


@inputs((1, 2, 3), (3, 1, 2), (2, 3, 1), (5, 5, 1), (1, 5, 5), (-1, -3, -2), (7, 7, 7))
def median_of_three(a, b, c):
    """Return the middle value of a, b and c once they are sorted."""
    return sorted([a, b, c])[1]


@inputs(12, 0, 7, -12, 100, -9, 59)
def last_digit(n):
    """Return the last decimal digit of the integer n, ignoring its sign."""
    return abs(n) % 10


@inputs((3, 1), (5, 5), (1, 3), (-2, 2), (0, 4), (4, 0), (-3, -1))
def sum_between(a, b):
    """Return the sum of the integers from a to b inclusive, in either order (3, 1 -> 6)."""
    if a > b:
        a, b = b, a
    return sum(range(a, b + 1))


@inputs(123, 0, 1, 2, 3, 8, 14)
def steps_to_zero(n):
    """Return how many steps take n >= 0 to 0, halving it when even, subtracting 1 when odd."""
    steps = 0
    while n > 0:
        n = n // 2 if n % 2 == 0 else n - 1
        steps += 1
    return steps


@inputs(100, 0, 1, -10, 50, 99, 150)
def water_state(temperature):
    """Return 'solid' at 0 degrees or below, 'gas' at 100 or above, else 'liquid'."""
    if temperature <= 0:
        return "solid"
    if temperature >= 100:
        return "gas"
    return "liquid"


@inputs(153, 10, 0, 1, 9, 154, 370, 371, 9474, 100)
def is_armstrong_number(n):
    """Return True if n equals the sum of its digits each raised to the number of digits."""
    digits = str(n)
    total = 0
    for d in digits:
        total += int(d) ** len(digits)
    return total == n


@inputs((7, 2), (1, 0), (6, 3), (0, 5), (-7, 2), (9, 4))
def safe_divide(a, b):
    """Return the integer division a // b, or None when b is 0."""
    if b == 0:
        return None
    return a // b


@inputs((1, 30, 2, 15), (1, 0, 2, 0), (0, 0, 23, 59), (5, 5, 5, 5), (10, 59, 11, 0), (0, 0, 0, 1))
def minutes_between(h1, m1, h2, m2):
    """Return the minutes from the time h1:m1 to the same or later time h2:m2 of one day."""
    return (h2 * 60 + m2) - (h1 * 60 + m1)


BASICS: tuple[Basic, ...] = tuple(v for v in dict(globals()).values() if isinstance(v, Basic))
